"""The expert slab's routing record and its counting: pure numpy, no device.

A step's routing reaches the host as one [n, R, k] int array (`StepRecord`: n
counted token rows, the R routed-layer calls the step recorded, top-k ids each)
with, per call, which experts sat in a slot when its router ran. `RoutingTally`
counts it:

- per routed layer since start (`SlabStats`): lookups, one per (step, layer
  call, distinct expert), hits (lookups that found the expert in a slot), and
  the token-to-expert assignments routed;
- per (layer, expert) since start: assignments (`routing`, what an expert
  profile counts);
- per segment (one counted sequence's rows, `StepRecord.segments`): that
  sequence's (lookups, hits, routed, routed_from_misses), summed over calls;
  two segments needing one expert each count it;
- for the slot policy, the step as `Routed`: what each call routed, and which
  of those were misses (`SlotPolicy.observe` turns them into scores and
  admission candidates).

The state is dense ([layer position, expert]; a call's layer position comes
from `StepRecord.pos`), so counting a step is a few vectorized numpy calls, not
Python per expert or per layer. Two shapes have paths of their own, with the
same counts as the general rule: a batch-1 decode step (one row, every routed
layer once, in order) touches only its R x k cells, not all R x E; decode
steps whose every segment is one row count each row's cells directly (a top-k
row never repeats an expert). Prefill and mixed steps take the general rule:
every row's (segment, call, expert) triple, made unique.

Under `--tp N` a card's slab holds a range of the experts (`owned`); its tally
counts only the assignments to them (the other cards count theirs, and the sums
over the cards are one card's counts of the whole model), through the general
rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from radianced.tiers.routing_buffers import RoutingBuffer

Key = tuple[int, int]  # (layer, expert)
ExpertCounts = tuple[int, int, int, int]  # (lookups, hits, routed, routed_from_misses) of one sequence


class SlabStats:
    """Per-layer expert lookups since start: one lookup per (step, layer, distinct expert), a hit
    when it sat in a slot, and the token-to-expert assignments routed. `RoutingTally` adds a step
    to `counts` ([(lookups, hits, routed), layer position], int64) in a few numpy calls; `lookups`,
    `hits` and `routed` read it as {layer: count}. The slab counts its refills, evictions and
    disk reads here too. Under --tp rank 0's slab adds the other cards' counts (`add`), and
    `other_slots` is their slots in use (not a count: `reset` leaves it)."""

    def __init__(self, layers: Sequence[int]):
        self.layers = tuple(layers)
        self.counts = np.zeros((3, len(self.layers)), dtype=np.int64)
        self.refills = 0
        self.evictions = 0
        self.disk_reads = 0  # experts the disk tier read for steps and admissions
        self.disk_bytes = 0  # their bytes (verified)
        self.other_slots = 0

    def reset(self) -> None:
        """Count from zero again: the daemon's warm-up traffic is not what it serves."""
        self.counts[:] = 0
        self.refills = self.evictions = self.disk_reads = self.disk_bytes = 0

    def totals(self) -> np.ndarray:
        """Every count as one int64 vector: [lookups, hits, routed] per layer position, then
        refills, evictions, disk reads, disk bytes (`add` takes it back)."""
        return np.concatenate((self.counts.ravel(), [self.refills, self.evictions, self.disk_reads, self.disk_bytes]))

    def add(self, totals: np.ndarray) -> None:
        """Add counts made elsewhere, as `totals` lays them out (--tp: another card's slab's)."""
        n = self.counts.size
        self.counts += totals[:n].reshape(self.counts.shape)
        refills, evictions, reads, nbytes = totals[n:n + 4].tolist()
        self.refills += refills
        self.evictions += evictions
        self.disk_reads += reads
        self.disk_bytes += nbytes

    @property
    def lookups(self) -> dict[int, int]:
        return dict(zip(self.layers, self.counts[0].tolist()))

    @property
    def hits(self) -> dict[int, int]:
        return dict(zip(self.layers, self.counts[1].tolist()))

    @property
    def routed(self) -> dict[int, int]:
        return dict(zip(self.layers, self.counts[2].tolist()))

    @property
    def total_lookups(self) -> int:
        return int(self.counts[0].sum())

    @property
    def total_hits(self) -> int:
        return int(self.counts[1].sum())


@dataclass(frozen=True)
class Recording:
    """One forward's routing on the device: the routed layers it called, in order, and their ids
    stacked (`ExpertSlab.record`)."""

    layers: tuple[int, ...]
    pos: np.ndarray | None  # [R] the calls' layer positions in the dense state; None: every routed layer once, in order
    ids: torch.Tensor  # [T, R, k]: row-major, so that the counted rows are its first ones


@dataclass(slots=True)
class StepRecord:
    """One launched step's routing, on its way to the host (`ExpertSlab.end_launch` -> `count`)."""

    layers: tuple[int, ...]  # the recorded layer calls, in order
    pos: np.ndarray | None  # as Recording.pos
    slotted: np.ndarray | None  # [R, E] bool: which experts each call's router found in a slot (read-only)
    buffer: RoutingBuffer | None  # its ids [T, R, k]: the host copy (filled by a queued copy); None: no routing
    rows: int  # the counted rows: ids[:rows] (a graph's padding rows after them are not)
    segments: list[tuple[int, int]]
    failed_rows: torch.Tensor | None  # [T] bool: rows routed to an expert that failed to read
    errors: list[str]

    def failures(self) -> tuple[list[int], list[str]]:
        """The step's rows whose routed experts failed to read, and the errors."""
        rows = [] if self.failed_rows is None else self.failed_rows.nonzero().flatten().tolist()
        return rows, self.errors


@dataclass(frozen=True, slots=True)
class Routed:
    """One counted step's routing per (layer call, expert): what the slot policy learns from it.
    A one-row step (every routed layer once, in order) comes as its R x k cells; any other as
    [R, E] arrays, one row per recorded call."""

    cells: np.ndarray | None  # [R * k] the one row's flat [layer position, expert] cells (none twice); None: per call
    hit: np.ndarray | None  # [R * k] bool: which of `cells` sat in a slot; None: per call
    assigned: np.ndarray | None  # [R, E] int64: assignments per (call, expert); None: one row
    missed: np.ndarray | None  # [R, E] bool: routed by the call and not in a slot; None: one row
    pos: np.ndarray | None  # [R] the calls' layer positions; None: every routed layer once, in order


def fold(pos: np.ndarray | None, per_call: np.ndarray, num_layers: int, axis: int = 0) -> np.ndarray:
    """Values of the recorded calls (along `axis`) as values of the `num_layers` routed layers
    (summed where a step called a layer twice; pos None: the calls are the layers, in order)."""
    if pos is None:
        return per_call
    shape = list(per_call.shape)
    shape[axis] = num_layers
    per_layer = np.zeros(shape, dtype=per_call.dtype)
    np.add.at(per_layer, (slice(None),) * axis + (pos,), per_call)
    return per_layer


class RoutingTally:
    """Counts launched steps' routing into `stats` and per-(layer, expert) assignments; with
    `owned` (first, stop), only the assignments to experts first..stop-1 (a card's under --tp)."""

    def __init__(self, stats: SlabStats, num_experts: int, owned: tuple[int, int] | None = None):
        self.stats, self.num_experts = stats, num_experts
        self.owned = None if owned is None or tuple(owned) == (0, num_experts) else tuple(owned)
        self.layers = stats.layers
        self.assigned = np.zeros((len(self.layers), num_experts), dtype=np.int64)  # since start
        # per (R, k) recorded calls: [R, k] call * E, each call's first (call, expert) cell; per R:
        # scratch [2, R, E] bool for a step's routed experts and those of them in a slot
        self._offsets: dict[tuple[int, int], np.ndarray] = {}
        self._scratch: dict[int, np.ndarray] = {}
        self._apart: list[tuple[int, int]] = []  # the segments of a step whose every row is one, in order

    @property
    def routing(self) -> dict[Key, int]:
        """Token-to-expert assignments since start, per (layer, expert) routed at least once."""
        return routing_of(self.layers, self.assigned)

    def restart(self) -> None:
        """Count the assignments from zero (`routing` then says since now)."""
        self.assigned[:] = 0

    def count(self, record: StepRecord, ids: np.ndarray) -> tuple[tuple[ExpertCounts, ...], Routed]:
        """Add a step's routing (ids [n, R, k]: n rows, the R recorded layer calls) to the per-layer
        stats and the assignments; returns each segment's counts, and the step for the policy."""
        n, R, k = ids.shape
        E, pos, slotted = self.num_experts, record.pos, record.slotted
        offsets = self._offsets.get((R, k))
        if offsets is None:
            offsets = self._offsets[R, k] = np.repeat(np.arange(R)[:, None] * E, k, axis=1)
            self._scratch[R] = np.empty((2, R, E), dtype=bool)
        cells = offsets + ids  # [n, R, k]: the (call, expert) cell of every assignment, call * E + expert
        segments = record.segments
        mine = None if self.owned is None else (ids >= self.owned[0]) & (ids < self.owned[1])  # [n, R, k]
        if n == 1 and pos is None and mine is None:
            routed = self._add_row(cells.reshape(-1), slotted, R, k)
            if segments == [(0, 1)]:  # a batch-1 decode step: its one sequence needed the row's R x k experts
                hits = int(np.count_nonzero(routed.hit))
                return ((R * k, hits, R * k, R * k - hits),), routed
        else:
            routed = self._add_rows(cells, slotted, pos, mine, R)
        return self._per_segment(segments, cells, slotted, mine), routed

    def _per_segment(self, segments: list[tuple[int, int]], cells: np.ndarray, slotted: np.ndarray,
                     mine: np.ndarray | None) -> tuple[ExpertCounts, ...]:
        """Each segment's (lookups, hits, routed, routed_from_misses) over cells [n, R, k], of the
        assignments `mine` marks (all if None)."""
        if not segments:
            return ()
        (n, R, k), E, S = cells.shape, self.num_experts, len(segments)
        if len(self._apart) != S:
            self._apart = [(i, i + 1) for i in range(S)]
        one_row = segments == self._apart  # every row its own segment, in order: a graph's decode step
        if one_row or all(end - start == 1 for start, end in segments):  # decode rows: no expert twice in a row
            at = slice(0, S) if one_row else [start for start, _ in segments]
            rows = cells[at]  # [S, R, k]
            hit = slotted.ravel().take(rows)
            if mine is None:
                lookups = R * k
                hits = hit.reshape(S, -1).sum(axis=1)
                return tuple([(lookups, h, lookups, lookups - h) for h in hits.tolist()])
            looked = mine[at].reshape(S, -1)
            hits, lookups = (hit.reshape(S, -1) & looked).sum(axis=1), looked.sum(axis=1)
            return tuple([(lk, h, lk, lk - h) for lk, h in zip(lookups.tolist(), hits.tolist())])
        seg = np.full(n, -1, dtype=np.int64)
        for i, (start, end) in enumerate(segments):
            seg[start:end] = i
        seg = np.broadcast_to(seg[:, None, None], cells.shape).reshape(-1)
        keep = seg >= 0 if mine is None else (seg >= 0) & mine.reshape(-1)
        seg_pairs, assigned = np.unique(seg[keep] * (R * E) + cells.reshape(-1)[keep], return_counts=True)
        seq, hit = seg_pairs // (R * E), slotted.ravel()[seg_pairs % (R * E)]
        counts = np.zeros((S, 4), dtype=np.int64)
        for col, w in enumerate((None, hit, assigned, assigned * ~hit)):
            counts[:, col] += np.bincount(seq, weights=w, minlength=S).astype(np.int64)
        return tuple(map(tuple, counts.tolist()))

    def _add_rows(self, cells: np.ndarray, slotted: np.ndarray, pos: np.ndarray | None, mine: np.ndarray | None,
                  R: int) -> Routed:
        """Add the rows' assignments (cells [n, R, k]; those `mine` marks, all if None) to the
        per-layer stats and the assignments, counted by (call, expert) over [R, E], not sorted: a
        prefill routes T x k a layer."""
        E, L = self.num_experts, len(self.layers)
        counted = cells.reshape(-1) if mine is None else cells[mine]
        by_pair = np.bincount(counted, minlength=R * E).reshape(R, E)
        looked = self._scratch[R]
        routed = np.greater(by_pair, 0, out=looked[0])  # [R, E]: the experts each call routed
        np.logical_and(routed, slotted, out=looked[1])  # ... that were in a slot
        stats = self.stats.counts  # [3, L]
        stats[:2] += fold(pos, looked.sum(axis=2), L, axis=1)
        stats[2] += fold(pos, by_pair.sum(axis=1), L)
        self.assigned += fold(pos, by_pair, L)
        return Routed(None, None, by_pair, routed > slotted, pos)  # missed: routed and not in a slot

    def _add_row(self, cells: np.ndarray, slotted: np.ndarray, R: int, k: int) -> Routed:
        """`_add_rows` for one row (a batch-1 decode step) of every routed layer once, in order
        (cells [R * k]): a top-k row never repeats an expert, so each cell is one lookup and one
        assignment, and the R x k cells are updated where they are instead of all R x E."""
        hit = slotted.ravel().take(cells)
        stats = self.stats.counts  # [3, L]
        stats[::2] += k  # lookups and assignments
        stats[1] += hit.reshape(R, k).sum(axis=1)
        self.assigned.ravel()[cells] += 1
        return Routed(cells, hit, None, None, None)


def routing_of(layers: Sequence[int], assigned: np.ndarray) -> dict[Key, int]:
    """{(layer, expert): assignments} of a [layers, E] count array (`RoutingTally.assigned`, or every
    card's summed under --tp), the pairs routed at least once."""
    pos, expert = np.nonzero(assigned)
    return {(layers[p], int(e)): int(assigned[p, e]) for p, e in zip(pos.tolist(), expert.tolist())}
