"""Steps as CUDA graphs, replayed with new inputs: decode steps by sequence count, other steps by token count.

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

Any other step (a verify step, prefill chunks beside decodes, a short prompt) of
T tokens wanting R logits rows runs the mixed graph of the smallest token bucket
t >= T whose logits rows are at least R (radianced/graph_shapes.py: which
buckets, and why); on a model with recurrent layers, only a verify step (every
sequence's rows run decoding's arithmetic: the verify ops read the sequences'
state slots from a static tensor, -1 for the empty slots). Its static batch has t
token rows and --max-num-seqs sequence slots: the step's own layout
(`HostLayout`, as the eager step's) fills the first rows and slots; rows T..t-1
are padding (token 0, position 0, KV slot -1) owned by no sequence, and the
empty slots own no rows (query start T, context 0), so no kernel reads or writes
anything for them past their own output rows. Three copies a step: the int64
rows, the int32 query starts and context lengths, the block tables.

What the graph sees change between replays is data, not addresses: the inputs,
the KV pages, the state slots' contents, the expert tables (patched in place
between steps, in stream order). State resets, restores and checkpoint saves
(`StepPlan.before`/`after`) are copies the runner queues on the same stream
before and after the replay. The slab's routing record of a step is one
[rows, R, k] tensor: the capture stacks the routed layers' ids into it inside the
graph (`ExpertSlab.record`), so each replay rewrites it and the slab takes it
(`ExpertSlab.replay`) with no launch of its own. Steps past the largest mixed
bucket, a hybrid model's steps with a prompt's chunk and the disk tier (a host
sync per layer) run eagerly.

Memory: all graphs share one graph pool, captured largest first, charged by
the receipt's "graph pool" workspace line; padding needs nothing beyond it. The
mixed graphs share one set of outputs (logits and routing ids: the largest's,
which each smaller one copies its own into, `_into`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radianced.graph_shapes import decode_buckets, mixed_logits_rows
from radianced.kv.cache import KVCache
from radianced.model.batch import ALIGN_BYTES, ForwardBatch, HostLayout, copy_rows
from radianced.model.layers import CausalLM

if TYPE_CHECKING:
    from radianced.tiers.routing import Recording

log = logging.getLogger("radianced.engine")


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


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [b, V] (decode) or [mixed_logits_rows, V] (mixed): the replay's output
    routing: Recording | None  # the slab's routing record, rewritten by each replay (ExpertSlab.record)


def _into(shared: _Graph, logits: torch.Tensor, routing: Recording | None) -> tuple[torch.Tensor, Recording | None]:
    """Inside a smaller mixed graph's capture: its logits and routing ids copied into the first rows of the
    largest mixed graph's (`shared`), which it returns in their place. Only one step's outputs are alive at a
    time (its sampling and its routing's host copy are queued before the next replay), so the mixed graphs
    hold one set of outputs between them instead of one each; each graph's own are freed to the pool for the
    next capture."""
    out = shared.logits[:len(logits)]
    out.copy_(logits)
    if routing is None:
        return out, None
    ids = shared.routing.ids[:len(routing.ids)]
    ids.copy_(routing.ids)
    return out, dataclasses.replace(routing, ids=ids)


class StepGraphs:
    """Captured step graphs of one model over one KV cache; `run` replays a decode step's, `run_mixed`
    any other step's."""

    def __init__(self, model: CausalLM, cache: KVCache, max_num_seqs: int, max_blocks: int, experts=None,
                 capture: bool = True, mixed: tuple[int, ...] = (), decode_tokens: int = 0):
        """max_blocks: block-table width (blocks of the longest sequence); experts: the model's
        ExpertSlab, if any; mixed: the mixed graphs' token buckets (`graph_shapes.mixed_buckets`; () for
        decode graphs only); decode_tokens: `Config.decode_tokens` (the mixed graphs' logits rows).
        capture=False runs the padded static batches eagerly instead of replaying (the CPU checks the
        layouts with it, and the slab's stacked routing record: each step records and replays it as a
        capture and a replay would)."""
        self.model, self.cache, self.experts = model, cache, experts
        self.buckets = decode_buckets(max_num_seqs)
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
        self.mixed = mixed
        self._mixed_rows = {t: mixed_logits_rows(t, decode_tokens) for t in mixed}
        self._mixed_graphs: dict[int, _Graph] = {}
        if mixed:
            self._mixed_inputs(max(mixed), max(self._mixed_rows.values()), b, pin)
        self.capture = capture
        if capture:
            self._capture_all()

    def bucket(self, n: int) -> int | None:
        """The bucket a decode step of n sequences runs in, or None (too many)."""
        return next((b for b in self.buckets if b >= n), None)

    def mixed_bucket(self, tokens: int, logits_rows: int, sequences: int) -> int | None:
        """The mixed graph a step of `tokens` rows over `sequences` sequences wanting `logits_rows` logits
        runs, or None (eager)."""
        if sequences > self.buckets[-1]:
            return None
        return next((t for t in self.mixed if t >= tokens and self._mixed_rows[t] >= logits_rows), None)

    def _mixed_inputs(self, t: int, r: int, s: int, pin: bool) -> None:
        """The mixed graphs' static inputs, for `t` rows, `r` logits rows and `s` sequence slots: int64 ids,
        positions, KV slots (each t), logits rows (r) and, on a hybrid model, state slots (s: its verify
        steps), int32 query starts (s + 1) and context lengths (s), each view on an ALIGN_BYTES boundary (the
        step's kernel variants are the eager ones'); a pinned host twin of each buffer. Until a step fills
        them: padding rows, empty slots."""
        def align(n: int, itemsize: int) -> int:
            per = ALIGN_BYTES // itemsize
            return -(-n // per) * per

        hybrid = self.cache.states is not None
        longs = (t, t, t, r, s) if hybrid else (t, t, t, r)
        at = [0]
        for n in longs:
            at.append(at[-1] + align(n, 8))
        self._m_longs = torch.zeros(at[-1], dtype=torch.int64, device=self.device)
        views = [self._m_longs[a:a + n] for a, n in zip(at, longs)]
        self._m_ids, self._m_pos, self._m_slots, self._m_rows = views[:4]
        self._m_slots.fill_(-1)
        self._m_states = views[4] if hybrid else None  # the sequence slots' state slots
        if hybrid:
            self._m_states.fill_(-1)  # empty: no state touched
        lens_at = align(s + 1, 4)
        self._m_ints = torch.zeros(lens_at + s, dtype=torch.int32, device=self.device)
        self._m_starts, self._m_lens = self._m_ints[:s + 1], self._m_ints[lens_at:]
        self._m_host_longs = torch.zeros(at[-1], dtype=torch.int64, pin_memory=pin)
        self._m_host_ints = torch.zeros(lens_at + s, dtype=torch.int32, pin_memory=pin)
        self._m_at, self._m_lens_at = at, lens_at

    def run_mixed(self, layout: HostLayout, pending: tuple[torch.Tensor | slice, torch.Tensor] | None = None,
                  state_slots: list[int] | None = None) -> torch.Tensor:
        """A step that is not decode-shaped, laid out as the eager step lays it out (`HostLayout.of`), in the
        mixed graph `mixed_bucket` gives it; returns the logits [R, V] (fp32) of layout.rows. pending: as
        in `run`, rows of the layout. state_slots: a hybrid model's, each sequence's (its step a verify step:
        every sequence's rows run decoding's arithmetic). The caller wraps it in the slab's
        begin_step/end_launch."""
        n_tok, n_seq, n_rows = len(layout.ids), len(layout.lens), len(layout.rows)
        t = self.mixed_bucket(n_tok, n_rows, n_seq)
        if t is None:
            raise ValueError(f"a step of {n_tok} tokens, {n_rows} logits rows and {n_seq} sequences fits no "
                             f"mixed graph (buckets {self.mixed}, {self.buckets[-1]} sequence slots)")
        longs, ints = self._m_host_longs.numpy(), self._m_host_ints.numpy()
        at, s = self._m_at, self.buckets[-1]
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have left the pinned buffers
        for i, (values, pad) in enumerate(((layout.ids, 0), (layout.positions, 0), (layout.slots, -1))):
            longs[at[i]:at[i] + n_tok] = values
            longs[at[i] + n_tok:at[i] + t] = pad  # padding rows: token 0, position 0, no KV write
        longs[at[3]:at[3] + n_rows] = layout.rows
        longs[at[3] + n_rows:at[3] + self._mixed_rows[t]] = 0
        if self._m_states is not None:
            longs[at[4]:at[4] + n_seq] = state_slots
            longs[at[4] + n_seq:at[4] + s] = -1
        ints[:n_seq + 1] = layout.starts
        ints[n_seq + 1:s + 1] = n_tok  # empty slots: no rows, no context
        ints[self._m_lens_at:self._m_lens_at + n_seq] = layout.lens
        ints[self._m_lens_at + n_seq:self._m_lens_at + s] = 0
        width = min(layout.tables.shape[1], self._host_tables_np.shape[1])
        self._host_tables_np[:n_seq, :width] = layout.tables[:, :width]
        nb = self.device.type == "cuda"
        self._m_longs.copy_(self._m_host_longs, non_blocking=nb)
        self._m_ints.copy_(self._m_host_ints, non_blocking=nb)
        self._tables[:n_seq, :width].copy_(self._host_tables[:n_seq, :width], non_blocking=nb)
        return self._replay(self._m_ids, pending, self._mixed_graphs.get(t), lambda: self._mixed_batch(t), n_rows)

    def _mixed_batch(self, t: int) -> ForwardBatch:
        """The static batch of mixed bucket t: views of the mixed inputs (module docstring). Its host
        tuples only say it is not decode-shaped: the kernels read the device tensors (a hybrid model's
        verify ops too: `all_decoding`, its sequences' state slots)."""
        s = self.buckets[-1]
        return ForwardBatch(
            input_ids=self._m_ids[:t], positions=self._m_pos[:t], slot_mapping=self._m_slots[:t],
            block_tables=self._tables[:s], logits_rows=self._m_rows[:self._mixed_rows[t]],
            query_start=(0,) * s + (t,), seq_lens=(0,) * s,
            query_start_t=self._m_starts, seq_lens_t=self._m_lens, state_slots=self._m_states,
            verify_slots=self._m_states, all_decoding=self._m_states is not None)

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
        return self._replay(self._ids, pending, self._graphs.get(b), lambda: self._batch(b), n)

    def _replay(self, ids: torch.Tensor, pending, graph: _Graph | None, batch, n: int) -> torch.Tensor:
        """After a step's input copies are queued: the previous step's samples into `ids` (`pending`), an
        event for the pinned buffers, then `graph`'s replay (with capture=False, `batch()` run eagerly, its
        routing recorded and replayed as a capture would); the first n logits rows."""
        if pending is not None:
            copy_rows(ids, *pending)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        if not self.capture:
            with torch.inference_mode():
                logits = self.model.forward(batch(), self.cache)
                if self.experts is not None:
                    self.experts.replay(self.experts.record())
            return logits[:n]
        graph.graph.replay()
        if self.experts is not None:
            self.experts.replay(graph.routing)
        return graph.logits[:n]

    def graph(self, b: int) -> torch.cuda.CUDAGraph:
        """Decode bucket b's captured graph (benchmarks: replaying it repeats the last step of that
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
        """Warm up and capture every bucket, mixed and decode, largest first, into one pool (padding rows
        only: no KV and no recurrent state is written). Python's cyclic garbage collector does not run
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
        shapes = [(self._mixed_graphs, t, self._mixed_batch) for t in sorted(self.mixed, reverse=True)] + \
            [(self._graphs, b, self._batch) for b in sorted(self.buckets, reverse=True)]  # largest first
        with torch.inference_mode(), torch.cuda.stream(stream):
            for _, size, batch in shapes:
                self._forward(batch(size))  # warm-up: Triton compiles, allocator settles
            # The warm-ups gave this thread's cuBLAS handle a workspace on this stream, in the default pool.
            # Dropped, the first capture allocates it in the graphs' pool, where the receipt's graph-pool
            # line charges it (charges.CAPTURE_WORKSPACE_BYTES); kept, it sat outside every charge.
            stream.synchronize()
            torch._C._cuda_clearCublasWorkspaces()
            shared: _Graph | None = None  # the largest mixed graph's outputs, which the others write into
            for graphs, size, batch in shapes:
                static = batch(size)
                graph = torch.cuda.CUDAGraph()
                self._begin()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self.model.forward(static, self.cache)
                    routing = self.experts.record() if self.experts is not None else None  # stacked in the graph
                    if shared is not None and graphs is self._mixed_graphs:
                        logits, routing = _into(shared, logits, routing)
                if self.experts is not None:
                    self.experts.end_step()  # nothing ran yet: the capture recorded, it did not count
                graphs[size] = _Graph(graph, logits, routing)
                if graphs is self._mixed_graphs and shared is None:
                    shared = graphs[size]
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize(self.device)
        mixed = f", mixed graphs at {', '.join(map(str, self.mixed))} tokens" if self.mixed else ""
        log.info("step graphs: decode at %s sequences%s; %d captured in %.1f s, %.2f MiB held",
                 ", ".join(map(str, self.buckets)), mixed, len(shapes), time.perf_counter() - t0,
                 (torch.cuda.memory_allocated(self.device) - before) / 2**20)

    def _begin(self) -> None:
        if self.experts is not None:
            self.experts.begin_step([], 0)  # a capture's routing is not a step's: nothing counted

    def _forward(self, batch: ForwardBatch) -> None:
        self._begin()
        self.model.forward(batch, self.cache)
        if self.experts is not None:
            self.experts.end_step()
