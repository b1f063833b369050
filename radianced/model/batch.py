"""What a model forward reads: a batch of sequences and the paged cache.

Every family's `forward` takes a `ForwardBatch` (all sequences of a step
flattened into one token axis) and a `KVCache` (kv/cache.py: paged K/V for the
attention layers, state slots for recurrent layers). No contiguous per-request
KV exists.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch



@dataclass(frozen=True)
class ForwardBatch:
    """One step's tokens. T tokens in all, B sequences.

    input_ids, positions, slot_mapping: [T]; sequence b owns token rows
    query_start[b]:query_start[b+1], the last tokens of its seq_lens[b] context
    tokens. block_tables: [B, max_blocks] (one paging group: the full-attention
    layers). state_slots: [B] recurrent-state slot of each sequence (hybrid
    models; a fresh sequence's slot is zeroed by its allocator; in a decode
    batch, slot < 0 is a padding row: zero output, no state touched).
    logits_rows: [R] token rows whose logits the caller wants; every_row: the host knows
    they are all T rows in order (decode), so the forward skips the gather.
    query_start_t [B+1], seq_lens_t [B]: int32 device copies of the host tuples
    (seq_lens_t int64 in the decode graphs' static batch), for kernels (no
    per-layer host -> device copy; capturable in a CUDA graph).
    The host tuples serve ops that loop per sequence on the CPU.
    state_slot_ids: state_slots on the host, for the hybrid's per-sequence loops (prefill, verify): reading
    them back from the device would sync the host with the device in every linear-attention layer. ()
    in the graphs' static batches, which only decode (their slots stay on the device).
    drafts: per sequence, how many of its last tokens are speculative drafts (a verify step; a
    hybrid model keeps the state after each of its positions, kv/cache.py); () when none drafts.
    decoding: on a hybrid step that is not decode-shaped, per sequence whether its rows run decoding's
    arithmetic (`runs_decoding`); () otherwise. verify_slots: the device's copy of that for the verify
    ops (all such sequences in one launch): [B] int64, each such sequence's state slot, -1 for a prompt's
    chunk (fla's, per sequence by `state_slot_ids`); None where `decoding` is ().
    all_decoding: every sequence's rows run decoding's arithmetic, read from the device tensors alone (a
    hybrid model's verify step in a mixed graph, engine/graphs.py: its host tuples are placeholders).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    logits_rows: torch.Tensor
    query_start: tuple[int, ...]
    seq_lens: tuple[int, ...]
    query_start_t: torch.Tensor
    seq_lens_t: torch.Tensor
    state_slots: torch.Tensor | None = None
    state_slot_ids: tuple[int, ...] = ()
    every_row: bool = False
    drafts: tuple[int, ...] = ()
    decoding: tuple[bool, ...] = ()
    verify_slots: torch.Tensor | None = None
    all_decoding: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]

    @property
    def is_decode(self) -> bool:
        """Every sequence feeds exactly one token (query_start is 0, 1, ..., B), as in the decode graphs."""
        return self.query_start == tuple(range(self.num_seqs + 1))

    @staticmethod
    def build(token_ids: list[list[int]], context_before: list[int], block_tables: list[list[int]],
              block_size: int, logits: str | list[int] = "last", state_slots: list[int] | None = None,
              device: torch.device | str = "cpu", drafts: list[int] | None = None) -> ForwardBatch:
        """Lay out B sequences' new tokens (`HostLayout.of`) and copy them to `device`."""
        h = HostLayout.of(token_ids, context_before, block_tables, block_size, logits)
        # three host-to-device copies: the int64 vectors as one, the int32 ones as one, the tables
        drafts = tuple(drafts) if drafts and any(drafts) else ()
        longs = [h.ids, h.positions, h.slots, h.rows]
        decoding: tuple[bool, ...] = ()
        if state_slots is not None:
            longs.append(np.asarray(state_slots, dtype=np.int64))
            if h.starts != list(range(len(h.starts))):  # not decode-shaped: the verify ops' slots too
                decoding = tuple(runs_decoding(hi - lo, drafts[b] if drafts else 0)
                                 for b, (lo, hi) in enumerate(zip(h.starts, h.starts[1:])))
                longs.append(np.asarray([slot if d else -1 for slot, d in zip(state_slots, decoding)],
                                        dtype=np.int64))
        ids_t, pos_t, slots_t, rows_t, *states_t = packed(longs, np.int64, device)
        starts_t, lens_t = packed([h.starts, list(h.lens)], np.int32, device)
        return ForwardBatch(
            input_ids=ids_t, positions=pos_t, slot_mapping=slots_t,
            block_tables=to_device_no_sync(torch.from_numpy(h.tables), device), logits_rows=rows_t,
            query_start=tuple(h.starts), seq_lens=h.lens,
            query_start_t=starts_t, seq_lens_t=lens_t,
            state_slots=states_t[0] if states_t else None,
            state_slot_ids=() if state_slots is None else tuple(state_slots), every_row=len(h.rows) == h.starts[-1],
            drafts=drafts, decoding=decoding, verify_slots=states_t[1] if len(states_t) > 1 else None,
        )


def runs_decoding(tokens: int, drafts: int) -> bool:
    """Whether a sequence's rows in a step run decoding's arithmetic on a hybrid model: a verify step's (its
    last token, then its drafts), or a single token (so a sequence's state never depends on what shares its
    step), not a prompt's chunk."""
    return drafts > 0 or tokens == 1


@dataclass(frozen=True)
class HostLayout:
    """A step's rows on the host, as `ForwardBatch.build` copies them (and the step graphs'
    static buffers take them: engine/graphs.py)."""

    ids: np.ndarray  # [T] int64 token ids
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64 KV slots
    rows: np.ndarray  # [R] int64 rows whose logits are wanted, in order
    starts: list[int]  # [B + 1] query_start
    lens: tuple[int, ...]  # [B] seq_lens
    tables: np.ndarray  # [B, width] int32 block tables, zero-padded

    @staticmethod
    def of(token_ids: list[list[int]], context_before: list[int], block_tables: list[list[int]],
           block_size: int, logits: str | list[int] = "last") -> HostLayout:
        """B sequences' new tokens; sequence b already has context_before[b] tokens cached.

        logits="last" asks for each sequence's last row, "all" for every row, and a
        list of B counts for that many of each sequence's last rows (a bool: its last row or none).
        """
        lens_q = [len(toks) for toks in token_ids]
        starts = [0, *itertools.accumulate(lens_q)]
        rows: list[int] = []
        for b, n in enumerate(lens_q):
            last = context_before[b] + n - 1
            if n and last // block_size >= len(block_tables[b]):
                raise ValueError(f"sequence {b}'s block table has {len(block_tables[b])} blocks; its tokens reach "
                                 f"position {last} (block {last // block_size})")
            if logits == "all":
                rows.extend(range(starts[b], starts[b + 1]))
            elif n and logits == "last":
                rows.append(starts[b + 1] - 1)
            elif n:
                rows.extend(range(starts[b + 1] - min(int(logits[b]), n), starts[b + 1]))
        width = max((len(t) for t in block_tables), default=0) or 1
        tables = np.zeros((len(block_tables), width), dtype=np.int32)
        for b, t in enumerate(block_tables):
            tables[b, : len(t)] = t
        lens = tuple(before + n for n, before in zip(lens_q, context_before))
        # every token at once (numpy, no per-token Python): its sequence, position and KV slot
        total = starts[-1]
        seq = np.repeat(np.arange(len(lens_q)), lens_q)
        pos = np.arange(total, dtype=np.int64) + np.repeat(
            np.asarray(context_before, dtype=np.int64) - starts[:-1], lens_q)
        slots = tables[seq, pos // block_size].astype(np.int64) * block_size + pos % block_size
        ids = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64, count=total)
        return HostLayout(ids, pos, slots, np.asarray(rows, dtype=np.int64), starts, lens, tables)


ALIGN_BYTES = 16  # Triton specializes a pointer on 16-byte alignment: each view starts on it


def packed(vectors: list, dtype: type, device: torch.device | str) -> list[torch.Tensor]:
    """The vectors on `device` in one copy, as views of one tensor that each start on an
    ALIGN_BYTES boundary: a view starting off it would make each kernel that reads it a variant
    of its own, built when a step of that shape first comes (kernels/compiles.py)."""
    per = ALIGN_BYTES // np.dtype(dtype).itemsize
    sizes = [len(v) for v in vectors]
    offsets = [0, *itertools.accumulate(-(-n // per) * per for n in sizes)]
    flat = np.zeros(offsets[-1], dtype=dtype)
    for v, at, n in zip(vectors, offsets, sizes):
        flat[at:at + n] = v
    whole = to_device_no_sync(torch.from_numpy(flat), device)
    return [whole[at:at + n] for at, n in zip(offsets, sizes)]


def to_device_no_sync(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`x` (a host tensor) on `device`. To a GPU through pinned memory with a non-blocking copy:
    a plain `.to(device)` waits for the whole stream, which would wait for a step in flight.
    (torch's pinned-memory cache keeps the staging block until the copy has run.)"""
    if torch.device(device).type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def copy_rows(dst: torch.Tensor, rows: torch.Tensor | slice, values: torch.Tensor) -> None:
    """`dst[rows] = values`, queued on the stream: rows a slice (one copy) or an int64 index tensor
    on dst's device (one index_copy_)."""
    if isinstance(rows, slice):
        dst[rows].copy_(values)
    else:
        dst.index_copy_(0, rows, values)
