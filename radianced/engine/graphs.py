"""Decode steps as CUDA graphs: one graph per batch-size bucket, replayed with new inputs.

A decode step (every sequence feeds one token and samples) of n sequences runs
the graph of the smallest bucket b >= n. The graph was captured over static
input tensors; a step copies its inputs into them (two copies queued on the
stream from pinned host buffers: the per-row int64 inputs as one tensor, and the
block tables) and replays. Rows n..b-1 are padding:
token 0 at position 0, KV slot -1 (the write is skipped), context length 1 over
whatever block row b holds (read, never written), recurrent-state slot -1 on
hybrid models (the DeltaNet ops give the row zeros and touch no state, so no
spare state slot exists), logits dropped. Their tokens are routed like any
token, so a padded row may read an expert no real row needed; the expert
accounting counts only the n real rows.

What the graph sees change between replays is data, not addresses: the inputs,
the KV pages, the state slots' contents, the expert tables (patched in place
between steps, in stream order). State resets, restores and checkpoint saves
(`StepPlan.before`/`after`) are copies the runner queues on the same stream
before and after the replay. The slab's routing record of a step is one
[b, R, k] tensor: the capture stacks the routed layers' ids into it inside the
graph (`ExpertSlab.record`), so each replay rewrites it and the slab takes it
(`ExpertSlab.replay`) with no launch of its own. Prefill, mixed steps and the
disk tier (a host sync per layer) run eagerly.

Memory: all buckets share one graph pool, captured largest first, charged by
the receipt's "graph pool" workspace line; padding needs nothing beyond it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radianced.kv.cache import KVCache
from radianced.model.batch import ForwardBatch, copy_rows
from radianced.model.layers import CausalLM

if TYPE_CHECKING:
    from radianced.tiers.routing import Recording

log = logging.getLogger("radianced.engine")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@contextlib.contextmanager
def _no_collection():
    """Collect garbage now, then keep the cyclic collector off until the block ends.

    A collection inside a capture runs the finalizers of whatever dead objects it finds, and
    some call CUDA: a dead engine's host pool or staging unpins its memory (`cudaHostUnregister`,
    tiers/host.py's finalizer), a pinned tensor's free records an event on the stream that
    used it. Any such call from the capturing process invalidates a global-mode capture, and
    the capture fails at its next launch with "operation failed due to a previous error during
    capture". Whether a collection lands inside a capture depends on Python's allocation
    counts, so the failure came and went (seen twice on the H200, at the DeltaNet decode launch
    of a hybrid model's capture, after earlier engines of the same process went unclosed).
    torch's `cuda.graph` collects before a capture only under `force_cudagraph_gc`.
    """
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def buckets_for(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes to capture: the standard buckets below max_num_seqs, and max_num_seqs."""
    return tuple(b for b in BUCKETS if b < max_num_seqs) + (max_num_seqs,)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [b, V]: the replay's output
    routing: Recording | None  # the slab's routing record, rewritten by each replay (ExpertSlab.record)


class DecodeGraphs:
    """Captured decode graphs of one model over one KV cache; `run` replays the right one."""

    def __init__(self, model: CausalLM, cache: KVCache, max_num_seqs: int, max_blocks: int, experts=None,
                 capture: bool = True):
        """max_blocks: block-table width (blocks of the longest sequence); experts: the model's
        ExpertSlab, if any. capture=False runs the padded static batch eagerly instead of
        replaying (the CPU checks the layout with it, and the slab's stacked routing record: each
        step records and replays it as a capture and a replay would)."""
        self.model, self.cache, self.experts = model, cache, experts
        self.buckets = buckets_for(max_num_seqs)
        self.device = cache.storage.device
        b = self.buckets[-1]
        dev = self.device

        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=dev)

        # the per-row inputs in one int64 tensor, one copy a step: ids, positions, KV slots, context
        # lengths and (hybrid models) recurrent-state slots, -1 (padding) until a step fills them, so
        # the warm-up and the capture touch no state
        self._inputs = zeros(5, b)
        self._inputs[3:].fill_(1)
        self._inputs[4].fill_(-1)
        self._ids, self._pos, self._slots, self._lens = self._inputs[:4]
        self._states = self._inputs[4] if cache.states is not None else None
        self._tables = zeros(b, max_blocks, dtype=torch.int32)
        self._query_start = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self._rows = torch.arange(b, dtype=torch.int64, device=dev)
        pin = dev.type == "cuda"
        self._host = torch.zeros((5, b), dtype=torch.int64, pin_memory=pin)  # the rows of _inputs
        self._host_tables = torch.zeros((b, max_blocks), dtype=torch.int32, pin_memory=pin)
        self._host_np, self._host_tables_np = self._host.numpy(), self._host_tables.numpy()
        self._graphs: dict[int, _Graph] = {}
        self._copied: torch.cuda.Event | None = None  # after the last step's input copies (CUDA)
        self.capture = capture
        if capture:
            self._capture_all()

    def bucket(self, n: int) -> int | None:
        """The bucket a decode step of n sequences runs in, or None (too many)."""
        return next((b for b in self.buckets if b >= n), None)

    def run(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]],
            state_slots: list[int | None], pending: tuple[torch.Tensor | slice, torch.Tensor] | None = None,
            ) -> torch.Tensor:
        """One decode step of n = len(token_ids) sequences (sequence i feeds token_ids[i] at
        positions[i] and, on a hybrid model, owns recurrent-state slot state_slots[i]; other
        models pass None slots, unread); returns logits [n, V] (fp32). pending: (rows [P] on the
        device or a slice, ids [P] on the device), input ids that replace token_ids[rows] (the
        previous step's samples: a device copy queued before the replay). The caller wraps it in
        the slab's begin_step/end_launch like an eager forward."""
        n = len(token_ids)
        b = self.bucket(n)
        bs = self.cache.block_size
        host, tables = self._host_np, self._host_tables_np  # numpy views of the pinned buffers
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have left the pinned buffers
        host[:, n:b] = ((0,), (0,), (-1,), (1,), (-1,))  # padding: token 0, position 0, no KV write, 1 key, no state
        host[0, :n] = token_ids
        host[1, :n] = positions
        host[2, :n] = [t[p // bs] * bs + p % bs for t, p in zip(block_tables, positions)]
        host[3, :n] = host[1, :n] + 1
        if self._states is not None:
            host[4, :n] = state_slots
        width = max(p // bs for p in positions) + 1
        for i, t in enumerate(block_tables):  # a table covers its own positions; the rest stays stale, unread
            w = min(len(t), width)
            tables[i, :w] = t[:w]
        nb = self.device.type == "cuda"
        rows = 5 if self._states is not None else 4
        self._inputs[:rows, :b].copy_(self._host[:rows, :b], non_blocking=nb)  # two copies in all
        self._tables[:n, :width].copy_(self._host_tables[:n, :width], non_blocking=nb)
        if pending is not None:
            copy_rows(self._ids, *pending)
        if nb:
            self._copied = torch.cuda.Event()
            self._copied.record()
        if not self.capture:
            with torch.inference_mode():
                logits = self.model.forward(self._batch(b), self.cache)
                if self.experts is not None:
                    self.experts.replay(self.experts.record())
            return logits[:n]
        g = self._graphs[b]
        g.graph.replay()
        if self.experts is not None:
            self.experts.replay(g.routing)
        return g.logits[:n]

    def graph(self, b: int) -> torch.cuda.CUDAGraph:
        """Bucket b's captured graph (benchmarks: replaying it repeats the last step of that
        bucket on the inputs `run` left, the device's work alone)."""
        return self._graphs[b].graph

    def _batch(self, b: int) -> ForwardBatch:
        """The static batch of bucket b: views of the input tensors."""
        return ForwardBatch(
            input_ids=self._ids[:b], positions=self._pos[:b], slot_mapping=self._slots[:b],
            block_tables=self._tables[:b], logits_rows=self._rows[:b],
            query_start=tuple(range(b + 1)), seq_lens=(1,) * b,
            query_start_t=self._query_start[:b + 1], seq_lens_t=self._lens[:b],
            state_slots=None if self._states is None else self._states[:b], every_row=True)

    def _capture_all(self) -> None:
        """Warm up and capture every bucket, largest first, into one pool (padding rows only:
        no KV and no recurrent state is written). Python's cyclic garbage collector does not run
        during the captures (`_no_collection`)."""
        with _no_collection():
            self._capture_buckets()

    def _capture_buckets(self) -> None:
        t0 = time.perf_counter()
        self._slots.fill_(-1)
        pool = torch.cuda.graph_pool_handle()
        before = torch.cuda.memory_allocated(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(stream):
            for b in sorted(self.buckets, reverse=True):
                self._forward(self._batch(b))  # warm-up: Triton compiles, allocator settles
            # The warm-ups gave this thread's cuBLAS handle a workspace on this stream, in the default pool.
            # Dropped, the first capture allocates it in the graphs' pool, where the receipt's graph-pool
            # line charges it (charges.CAPTURE_WORKSPACE_BYTES); kept, it sat outside every charge.
            stream.synchronize()
            torch._C._cuda_clearCublasWorkspaces()
            for b in sorted(self.buckets, reverse=True):
                batch = self._batch(b)
                graph = torch.cuda.CUDAGraph()
                self._begin()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self.model.forward(batch, self.cache)
                    routing = self.experts.record() if self.experts is not None else None  # stacked in the graph
                if self.experts is not None:
                    self.experts.end_step()  # nothing ran yet: the capture recorded, it did not count
                self._graphs[b] = _Graph(graph, logits, routing)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("decode graphs: %d buckets (%s) captured in %.1f s, %.2f MiB held", len(self.buckets),
                 ", ".join(map(str, self.buckets)), time.perf_counter() - t0,
                 (torch.cuda.memory_allocated(self.device) - before) / 2**20)

    def _begin(self) -> None:
        if self.experts is not None:
            self.experts.begin_step([], 0)  # a capture's routing is not a step's: nothing counted

    def _forward(self, batch: ForwardBatch) -> None:
        self._begin()
        self.model.forward(batch, self.cache)
        if self.experts is not None:
            self.experts.end_step()
