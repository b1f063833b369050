"""The expert slab: VRAM expert slots leased from the arena, and the pointer table.

Implements the model's `ExpertSource`. For every routed layer `table(layer)[e]`
says where expert e's weights are right now:

    entry >= 0   slot `entry`: row `entry` of `slab` (the arena's pages as [P, 3*I*H]), or
                 during a step a row of the disk tier's buffers (the arena's reserved pages)
    entry <  0   host row `-1 - entry` of `host` (the pinned host pool: an overflow read)
    MISSING      a disk-homed expert without a slot: nothing may read it until a step routes it

On CUDA these become raw addresses the fused MoE kernel loads through; on the
CPU they are row indices the reference MoE reads with `index_select`. The
table tensors are patched in place, so a captured graph sees one tensor whose
contents change.

Slots: the placement's pinned experts (home on the card: never evicted) and a
cache of host experts, pre-filled in rank order. The slab is the arena's
expert tenant: when KV needs pages the arena calls `surrender`, which gives up
the coldest cached slots (their home is the host pool, so eviction costs a
re-read, never data), down to the policy's floor. Between steps `rebalance`
admits hot host experts into free pages, or in place of a colder slot.

Disk tier (`--weights-disk-tier`): experts whose home is the model file have
no host row. When a step's router sends tokens to one without a slot,
`prepare` reads it (ExpertLoader: io_uring, O_DIRECT, checksum) into the
layer's disk buffer (two halves of the arena's reserved pages, alternating by
routed layer) and points the table there until the step ends. A failed read
points the expert at a zeroed row, so only the tokens routed to it compute
garbage; the step's `StepRecord.failures()` names their rows and the error, and the runner fails
exactly the requests those rows belong to.

A step in three calls: `begin_step` before its forward, `end_launch` after it is
queued (the routing ids go to a pinned host buffer of that step's own with a
non-blocking copy: no wait), `count(record)` once the step is done. The routing
is one [T, R, k] tensor of the R recorded layer calls: an eager step stacks the
ids `prepare` recorded at `end_launch`; a decode graph stacks them inside its
capture (`record`), so a replay rewrites that tensor and `replay` hands it over
with no launch of the slab's own. With a step in flight ahead of the one being
counted, each step's copy lands in its own buffer (routing_buffers.py: lent at
`end_launch`, taken back once `count` has read it), and hits are judged by the
table the step's router saw (a snapshot at `end_launch`), not by the table
`rebalance` patched since: its patches are stream-ordered behind every step
already queued. The snapshot is a [layer, expert] bool array of which experts
sit in a slot, shared with the record and copied only when a patch comes while
a record holds it.

Policy: frequency with exponential decay over steps (`DECAY` per step), with
admission control. Pure LRU thrashes when a step routes more distinct experts
than there are slots; profile-static never adapts to the traffic. Decayed
counts keep the experts that keep being routed, but admitting every miss (as a
first version did) churned: on the H200 at 25% coverage under a Zipf router it
refilled 8 slots every step, each refill a copy as dear as the miss it saves,
and decoded slower than at 10% coverage. So a missed expert takes a slot only
when it was routed more than once lately (`ADMIT_MIN`) and is clearly hotter
than the slot's coldest expert (`ADMIT_MARGIN`), and the half-life is a few
dozen steps, not a few. Decay is lazy (a growing gain scales new counts) and
the per-expert state is dense numpy ([layer, expert]), as are the per-layer
stats, so counting a step and choosing victims are a few vectorized calls, not
Python per expert or per layer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from radianced.arena import EXPERTS, PASSED, Arena, Fence, Lease, OutOfPages
from radianced.tiers.expert_loader import ExpertLoader
from radianced.tiers.routing_buffers import RoutingBuffer, RoutingBuffers
from radianced.tiers.placement import CARD, DISK, HOST, Key, Placement

log = logging.getLogger("radianced.experts")

DECAY = 0.98  # per step: a count halves in about 34 steps
ADMIT_MIN = 1.5  # decayed routings a missed expert needs before it may take a slot
ADMIT_MARGIN = 1.5  # ... and how much hotter than the slot's coldest expert, which it replaces
MAX_REFILLS = 8  # slots refilled per rebalance: bounds the copy work between steps
MISSING = -(1 << 62)  # table entry of a disk-homed expert without a slot (out of every tensor's range)


class SlabError(RuntimeError):
    """The slots cannot be filled at start (a pinned or pre-filled expert failed to read)."""


class SlabStats:
    """Per-layer expert lookups since start: one lookup per (step, layer, distinct expert), a hit
    when it sat in a slot, and the token-to-expert assignments routed. The slab adds a step to
    `counts` ([(lookups, hits, routed), layer position], int64) in a few numpy calls; `lookups`,
    `hits` and `routed` read it as {layer: count}."""

    def __init__(self, layers: Sequence[int]):
        self.layers = tuple(layers)
        self.counts = np.zeros((3, len(self.layers)), dtype=np.int64)
        self.refills = 0
        self.evictions = 0
        self.disk_reads = 0  # experts the disk tier read for steps and admissions
        self.disk_bytes = 0  # their bytes (verified)

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


ExpertCounts = tuple[int, int, int, int]  # (lookups, hits, routed, routed_from_misses) of one sequence
# one routed layer's call of a step: (layer, ids [T, k], which experts were in a slot when its router ran
# ([E] bool, taken before the disk tier staged any), or None: the table as it is at end_launch, unchanged
# during the step without a disk tier)
Recorded = tuple[int, torch.Tensor, "np.ndarray | None"]


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


class ExpertSlab:
    def __init__(self, arena: Arena, width: int, dtype: torch.dtype, placement: Placement,
                 host: torch.Tensor | None, loader: ExpertLoader | None, num_experts: int,
                 max_slots: int | None = None):
        """width: elements of one expert extent; host: [placement.count(HOST), width] rows in
        placement.host_row order; loader: reads extents from the model file into slab rows (the
        pinned experts, disk-homed ones; needed when the placement has any); max_slots:
        --expert-slots (None: as many as the arena lends). Leases and fills every start slot."""
        if (placement.pinned or placement.disk) and loader is None:
            raise ValueError("experts pinned on the card or homed on disk are read from the file: give a loader")
        if placement.disk and len(arena.reserved) < 2:
            raise ValueError(f"{len(placement.disk)} experts have their home on disk, and the arena has no "
                             f"reserved pages for the disk tier's buffers (a receipt with --weights-disk-tier)")
        self.arena, self.placement, self.host, self.loader = arena, placement, host, loader
        self.slab = arena.paged_view(dtype, (width,))  # [P + reserved, width]
        self.max_slots = max_slots
        half = len(arena.reserved) // 2
        self._buffers = (arena.reserved[:half], arena.reserved[half:2 * half])
        layers = sorted({layer for layer, _ in placement.pinned + placement.host + placement.disk})
        self._layers = tuple(layers)
        self._layer_pos = {layer: i for i, layer in enumerate(layers)}
        self._tables = {layer: torch.empty(num_experts, dtype=torch.int64, device=self.slab.device)
                        for layer in layers}
        # Dense [routed layer position, expert] state on the host, so a step is counted in a few
        # numpy calls: the tables' contents (readable without a device sync), decayed routing counts
        # (lazily: score = raw / gain, and the gain grows 1/DECAY a step), exact routing counts since
        # start (what a profile counts), the last step's misses (admission candidates), which
        # experts sit in a cache slot (pinned ones excluded: never evicted), and which sit in any
        # slot (entry >= 0: what a hit is judged by; shared with a launched step's record until
        # the next patch copies it).
        shape = (len(layers), num_experts)
        self._entries = np.full(shape, MISSING, dtype=np.int64)
        self._slotted = np.zeros(shape, dtype=bool)
        self._shared = False  # a launched step's record holds _slotted: patch a copy
        self._raw = np.zeros(shape)
        self._gain = 1.0
        self._routing = np.zeros(shape, dtype=np.int64)
        self._missed = np.zeros(shape, dtype=bool)
        self._cached = np.zeros(shape, dtype=bool)
        for key in placement.host + placement.disk:
            self._point(key, self._home_entry(key))
        self._pinned = frozenset(placement.pinned)
        self._slot_of: dict[Key, int] = {}
        self.stats = SlabStats(layers)
        self.num_experts = num_experts
        self.extent_bytes = width * dtype.itemsize  # what one overflow read moves over the link
        self._recorded: list[Recorded] = []  # this step's routing, counted by end_step
        self._replayed: Recording | None = None  # or this step's, as a graph replay left it (replay)
        self._copies = RoutingBuffers(self.slab.device.type == "cuda")  # the steps' routing on the host
        # per (R, k) recorded calls: [R, k] call * E, each call's first (call, expert) cell; per R:
        # scratch [2, R, E] bool for a step's routed experts and those of them in a slot
        self._offsets: dict[tuple[int, int], np.ndarray] = {}
        self._scratch: dict[int, np.ndarray] = {}
        self._apart: list[tuple[int, int]] = []  # the segments of a step whose every row is one, in order
        self._segments: list[tuple[int, int]] = []  # row ranges counted apart (begin_step)
        self._num_rows = 0
        self._staged: list[Key] = []  # disk experts pointed at a buffer row for this step
        self._failed_rows: torch.Tensor | None = None  # [T] bool: rows routed to an expert that failed to read
        self._failures: list[str] = []
        start = placement.pinned + placement.prefill
        t0 = time.perf_counter()
        pages = arena.lease(EXPERTS, len(start)).pages
        failed = self._fill_many(list(zip(start, pages)))
        if failed:
            raise SlabError(f"cannot fill the expert slots at start: {failed[0]}"
                            + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""))
        self.fill_seconds = time.perf_counter() - t0
        if loader is not None:
            loader.drain_latencies()  # the start fill is not the disk tier's traffic
        arena.register(EXPERTS, self)

    # -- ExpertSource ------------------------------------------------------------

    @property
    def stages_experts(self) -> bool:
        """Whether `prepare` reads routed experts in: with disk homes."""
        return bool(self.placement.disk)

    def table(self, layer: int) -> torch.Tensor:
        return self._tables[layer]

    def prepare(self, layer: int, expert_ids: torch.Tensor) -> None:
        """Record the step's routing of `layer` ([T, k] ids) for `end_step` to count. Without disk
        homes this is all: no host sync, so a CUDA graph can capture it (host-resident experts are
        read in place by the MoE), and the ids are first read by `record` or `end_launch`, queued
        after the forward (the MoE may still be computing them when it calls this). With disk
        homes, the routed ones without a slot are read into the layer's disk buffer first (a host
        sync), and the hits are judged before that."""
        if not self.placement.disk:
            self._recorded.append((layer, expert_ids, None))
            return
        entries = self._entries[self._layer_pos[layer]]
        self._recorded.append((layer, expert_ids, entries >= 0))  # the table as the router found it
        routed = torch.unique(expert_ids).tolist()
        missing = [e for e in routed if entries[e] == MISSING]
        if missing:
            self._stage(layer, missing, expert_ids)

    def record(self) -> Recording:
        """What `prepare` recorded since `begin_step`, its ids stacked into one [T, R, k] tensor (one
        launch). A decode graph calls it inside its capture, so that each replay rewrites the
        stacked ids and `replay` hands them over with no launch per step. Not with disk homes:
        their steps judge hits by per-call snapshots and run eagerly."""
        if self.placement.disk:
            raise RuntimeError("steps with disk-homed experts run eagerly: their routing is not replayed")
        return self._recording(self._recorded)

    def replay(self, recording: Recording) -> None:
        """After a graph replay: `recording` (from `record` at capture; the replay rewrote its ids)
        is this step's routing."""
        self._recorded, self._replayed = [], recording

    def _recording(self, recorded: list[Recorded]) -> Recording:
        layers = tuple(r[0] for r in recorded)
        pos = None if layers == self._layers else np.array([self._layer_pos[layer] for layer in layers])
        return Recording(layers, pos, torch.stack([r[1] for r in recorded], dim=1))

    def _stage(self, layer: int, missing: list[int], expert_ids: torch.Tensor) -> None:
        """Read `missing` experts of `layer` into its disk buffer and point the table at them."""
        buffer = self._buffers[self._layer_pos[layer] % 2]
        if len(missing) > len(buffer):
            raise RuntimeError(f"layer {layer} routed {len(missing)} disk experts in one step; its buffer holds "
                               f"{len(buffer)} (the receipt sizes it for --max-num-batched-tokens)")
        keys = [(layer, e) for e in missing]
        results = self.loader.load(keys, buffer[:len(keys)])
        for key, row, r in zip(keys, buffer, results):
            self._point(key, row)
            self._staged.append(key)
            if r.ok:
                self.stats.disk_reads += 1
                self.stats.disk_bytes += r.nbytes
                continue
            self.slab[row].zero_()  # its tokens get no contribution from it; their requests fail
            rows = (expert_ids == key[1]).any(dim=-1)
            self._failed_rows = rows if self._failed_rows is None else self._failed_rows | rows
            self._failures.append(r.error)

    def drain_disk_latencies(self) -> list[float]:
        """Seconds per disk-tier expert read since the last call."""
        return self.loader.drain_latencies() if self.loader is not None else []

    # -- per-sequence accounting (SPEC §9: the per-request line) -------------------

    def begin_step(self, segments: Sequence[tuple[int, int]], num_rows: int) -> None:
        """Before a forward of `num_rows` token rows (a CUDA graph may run more: padding, not
        counted): count the routing of each segment (start, end) of rows apart (one segment per
        counted sequence) until `end_step`. A lookup is one (layer, expert) a segment's rows
        needed this step, a hit found it in a slot at that time; two segments needing one
        expert each count it."""
        self._failed_rows, self._failures = None, []
        self._recorded, self._replayed = [], None
        self._segments, self._num_rows = list(segments), num_rows

    def end_step(self) -> tuple[ExpertCounts, ...]:
        """`count(end_launch())`: the step's counts, waiting for its routing."""
        return self.count(self.end_launch())

    def end_launch(self) -> StepRecord:
        """After a forward is queued: take its routing record (the ids go to the host with a queued
        copy, not waited for) and end the step's recording. Disk experts read for the step stop
        being addressable (their buffer rows are reused). Call once after each forward."""
        for key in self._staged:
            self._point(key, MISSING)
        self._staged = []
        recorded, self._recorded = self._recorded, []
        recording, self._replayed = self._replayed, None
        if recording is None and recorded:
            recording = self._recording(recorded)  # eager: one stack for the step
        layers, pos, slotted, buffer = (), None, None, None
        if recording is not None:
            layers, pos = recording.layers, recording.pos
            if self.placement.disk:  # the snapshots taken before each layer's staging
                slotted = np.stack([r[2] for r in recorded])
            elif pos is None:
                slotted, self._shared = self._slotted, True
            else:
                slotted = self._slotted[pos]
            buffer = self._copies.take(recording.ids.shape)  # this step's own until counted
            buffer.ids.copy_(recording.ids, non_blocking=True)
            buffer.mark_copied()
        record = StepRecord(layers, pos, slotted, buffer, self._num_rows, self._segments, self._failed_rows,
                            self._failures)
        self._segments, self._failed_rows, self._failures = [], None, []
        return record

    def count(self, record: StepRecord) -> tuple[ExpertCounts, ...]:
        """Count a launched step (per layer; scores; its segments, summed over layers) once its
        routing copy is done (waits for it); returns the segments' counts. Steps are counted in
        launch order, each once: its host buffer then goes back to be reused."""
        buffer = record.buffer
        if buffer is None:
            return ((0, 0, 0, 0),) * len(record.segments)
        buffer.wait()
        counts = self._count(record, buffer.array[:record.rows])
        record.buffer = None
        self._copies.give(buffer)
        return counts

    def _count(self, record: StepRecord, ids: np.ndarray) -> tuple[ExpertCounts, ...]:
        """Add a step's routing (ids [n, R, k]: n rows, the R recorded layer calls) to the per-layer
        stats, the scores, the routing counts and the misses; returns each segment's counts."""
        n, R, k = ids.shape
        E, pos, slotted = self.num_experts, record.pos, record.slotted
        offsets = self._offsets.get((R, k))
        if offsets is None:
            offsets = self._offsets[R, k] = np.repeat(np.arange(R)[:, None] * E, k, axis=1)
            self._scratch[R] = np.empty((2, R, E), dtype=bool)
        cells = offsets + ids  # [n, R, k]: the (call, expert) cell of every assignment, call * E + expert
        segments = record.segments
        if n == 1 and pos is None:
            hits = self._add_row(cells.reshape(-1), slotted, R, k)
            if segments == [(0, 1)]:  # a batch-1 decode step: its one sequence needed the row's R x k experts
                return ((R * k, hits, R * k, R * k - hits),)
        else:
            self._add_rows(cells, slotted, pos, n, R, k)
        if not segments:
            return ()
        S = len(segments)
        if len(self._apart) != S:
            self._apart = [(i, i + 1) for i in range(S)]
        one_row = segments == self._apart  # every row its own segment, in order: a graph's decode step
        if one_row or all(end - start == 1 for start, end in segments):  # decode rows: no expert twice in a row
            rows = cells[:S] if one_row else cells[[start for start, _ in segments]]  # [S, R, k]
            lookups = R * k
            hits = slotted.ravel().take(rows).reshape(S, -1).sum(axis=1)
            return tuple([(lookups, h, lookups, lookups - h) for h in hits.tolist()])
        seg = np.full(n, -1, dtype=np.int64)
        for i, (start, end) in enumerate(segments):
            seg[start:end] = i
        seg = np.broadcast_to(seg[:, None, None], ids.shape).reshape(-1)
        keep = seg >= 0
        seg_pairs, assigned = np.unique(seg[keep] * (R * E) + cells.reshape(-1)[keep], return_counts=True)
        seq, hit = seg_pairs // (R * E), slotted.ravel()[seg_pairs % (R * E)]
        counts = np.zeros((S, 4), dtype=np.int64)
        for col, w in enumerate((None, hit, assigned, assigned * ~hit)):
            counts[:, col] += np.bincount(seq, weights=w, minlength=S).astype(np.int64)
        return tuple(map(tuple, counts.tolist()))

    def _add_rows(self, cells: np.ndarray, slotted: np.ndarray, pos: np.ndarray | None, n: int, R: int,
                  k: int) -> None:
        """Add n rows' assignments (cells [n, R, k]) to the per-layer stats, the scores, the routing
        counts and the misses, counted by (call, expert) over [R, E], not sorted: a prefill routes
        T x k a layer."""
        E = self.num_experts
        by_pair = np.bincount(cells.reshape(-1), minlength=R * E).reshape(R, E)
        looked = self._scratch[R]
        routed = np.greater(by_pair, 0, out=looked[0])  # [R, E]: the experts each call routed
        np.logical_and(routed, slotted, out=looked[1])  # ... that were in a slot
        stats = self.stats.counts  # [3, L]
        stats[:2] += self._fold(pos, looked.sum(axis=2), axis=1)
        stats[2] += n * k if pos is None else self._fold(pos, np.full(R, n * k))
        self._raw += self._fold(pos, by_pair * self._gain)
        self._routing += self._fold(pos, by_pair)
        self._missed |= self._fold(pos, routed > slotted)  # routed and not in a slot

    def _add_row(self, cells: np.ndarray, slotted: np.ndarray, R: int, k: int) -> int:
        """`_add_rows` for one row (a batch-1 decode step) of every routed layer once, in order
        (cells [R * k]): a top-k row never repeats an expert, so each cell is one lookup and one
        assignment, and the R x k cells are updated where they are instead of all R x E. Returns
        the row's hits."""
        hit = slotted.ravel().take(cells)
        stats = self.stats.counts  # [3, L]
        stats[::2] += k  # lookups and assignments
        stats[1] += hit.reshape(R, k).sum(axis=1)
        self._raw.ravel()[cells] += self._gain
        self._routing.ravel()[cells] += 1
        self._missed.ravel()[cells[~hit]] = True
        return int(np.count_nonzero(hit))

    def _fold(self, pos: np.ndarray | None, per_call: np.ndarray, axis: int = 0) -> np.ndarray:
        """Values of the recorded calls (along `axis`) as values of the routed layers (summed where a
        step called a layer twice; pos None: the calls are the layers, in order)."""
        if pos is None:
            return per_call
        shape = list(per_call.shape)
        shape[axis] = len(self._layers)
        per_layer = np.zeros(shape, dtype=per_call.dtype)
        np.add.at(per_layer, (slice(None),) * axis + (pos,), per_call)
        return per_layer

    @property
    def routing(self) -> dict[Key, int]:
        """Token-to-expert assignments since start, per (layer, expert) routed at least once."""
        pos, expert = np.nonzero(self._routing)
        return {(self._layers[p], int(e)): int(self._routing[p, e]) for p, e in zip(pos.tolist(), expert.tolist())}

    # -- the arena's reclaimer -----------------------------------------------------

    def surrenderable(self) -> int:
        """Slots `surrender` could give up now (the cached ones; pinned experts stay)."""
        return len(self._slot_of) - len(self._pinned)

    def reclaim_cost(self) -> float:
        """Cost per byte of giving up a slot: re-reading the coldest expert over the link,
        weighted by how hot it still is (KV blocks are compared with recompute cost)."""
        cold = self._coldest()
        return self._score(cold) + 1.0 if cold else float("inf")

    def surrender(self, n: int) -> tuple[Lease, Fence]:
        """Give up to n cached (non-pinned) slots, coldest first; their table entries point
        back at the host pool before the pages leave."""
        pages = []
        while len(pages) < n and (cold := self._coldest()) is not None:
            pages.append(self._evict(cold))
        pages = tuple(pages)
        return Lease(EXPERTS, pages), PASSED  # CPU: no queued step reads the old rows

    # -- between steps -------------------------------------------------------------

    def rebalance(self, max_refills: int = MAX_REFILLS) -> int:
        """Decay scores, then admit the hottest experts the last step missed (routed at least
        `ADMIT_MIN` lately): into free pages the arena lends, else in place of the coldest
        cached slot if `ADMIT_MARGIN` times hotter. Returns refills."""
        self._gain /= DECAY
        if self._gain > 1e100:
            self._renormalize()
        candidates = np.flatnonzero(self._missed & (self._entries < 0))  # missed, still without a slot
        self._missed[:] = False
        candidates = candidates[np.argsort(-self._raw.flat[candidates], kind="stable")][:max_refills]
        E = self.num_experts
        admitted: list[tuple[Key, int]] = []
        for cell in candidates.tolist():
            key = (self._layers[cell // E], cell % E)
            if self._raw.flat[cell] / self._gain < ADMIT_MIN:
                break
            page = self._lease_one(pending=len(admitted))
            if page is None:
                cold = self._coldest()
                if cold is None or ADMIT_MARGIN * self._raw[self._cell(cold)] >= self._raw.flat[cell]:
                    break
                page = self._evict(cold)  # the page stays ours: refilled in place, in stream order
            admitted.append((key, page))
        failed = self._fill_many(admitted)
        for error in failed:
            log.warning("expert not admitted to a slot: %s", error)
        refills = len(admitted) - len(failed)
        self.stats.refills += refills
        return refills

    @property
    def num_slots(self) -> int:
        return len(self._slot_of)

    def slotted(self) -> frozenset[Key]:
        return frozenset(self._slot_of)

    # -- internals -----------------------------------------------------------------

    def _lease_one(self, pending: int = 0) -> int | None:
        """A page from the arena (free, or taken back from idle KV), or None if the policy or
        --expert-slots says no (`pending`: pages leased for slots not filled yet)."""
        if self.arena.available(EXPERTS) == 0 or \
                self.max_slots is not None and self.num_slots + pending >= self.max_slots:
            return None
        try:
            return self.arena.lease(EXPERTS, 1).pages[0]
        except OutOfPages:  # what KV gave back stays in its buffer of free pages
            return None

    def _fill_many(self, pairs: list[tuple[Key, int]]) -> list[str]:
        """Fill page p with expert k for each (k, p): host experts from their pool row, the others
        from the file through the loader. A failed read gives its page back; returns the errors."""
        from_file = [(k, p) for k, p in pairs if self.placement.home(*k) != HOST]
        for key, page in pairs:
            if self.placement.home(*key) == HOST:  # from the pinned pool, queued behind the steps in flight
                self.slab[page].copy_(self.host[self.placement.host_row(*key)], non_blocking=True)
                self._take_slot(key, page)
        errors = []
        if from_file:
            results = self.loader.load([k for k, _ in from_file], [p for _, p in from_file])
            for (key, page), r in zip(from_file, results):
                if r.ok:
                    if self.placement.home(*key) == DISK:
                        self.stats.disk_reads += 1
                        self.stats.disk_bytes += r.nbytes
                    self._take_slot(key, page)
                else:
                    errors.append(r.error)
                    self.arena.release(Lease(EXPERTS, (page,)))
        return errors

    def _take_slot(self, key: Key, page: int) -> None:
        self._slot_of[key] = page
        self._point(key, page)
        self._cached[self._cell(key)] = key not in self._pinned

    def verify_slot(self, slot: int) -> Key:
        """Check slot `slot`'s bytes against the file's checksum of the expert it holds (a copy to
        the host); returns that expert. Raises SlabError on a mismatch."""
        key = next(k for k, p in self._slot_of.items() if p == slot)
        extent = self.loader.reader.extents[key]
        data = self.slab[slot].view(torch.uint8).cpu().numpy()
        if xxhash.xxh3_64_intdigest(data) != extent.checksum:
            raise SlabError(f"slot {slot} (layer {key[0]}, expert {key[1]}) does not match the model file's "
                            f"checksum after the start fill: the card's memory or the copy is faulty")
        return key

    def fill_line(self, ranked: bool) -> str:
        """The start-up line: slots pre-filled, how fast, and one slot checked against the file."""
        n = len(self._slot_of)
        mb = n * self.extent_bytes / 1e6
        rate = mb / self.fill_seconds if self.fill_seconds > 0 else float("inf")
        order = "from the profile" if ranked else "in file order"
        checked = ""
        if n and self.loader is not None:
            self.verify_slot(min(self._slot_of.values()))
            checked = f"; slot {min(self._slot_of.values())} verified"
        return f"pre-filled {n} slots {order} in {self.fill_seconds:.2f} s ({rate:.0f} MB/s){checked}"

    def _evict(self, key: Key) -> int:
        page = self._slot_of.pop(key)
        self._point(key, self._home_entry(key))
        self._cached[self._cell(key)] = False
        self.stats.evictions += 1
        return page

    def _home_entry(self, key: Key) -> int:
        """The table entry of an expert without a slot: its host row, or MISSING (disk home)."""
        home = self.placement.home(*key)
        if home == CARD:
            raise ValueError(f"expert (layer {key[0]}, expert {key[1]}) is pinned on the card: it always has a slot")
        return -1 - self.placement.host_row(*key) if home == HOST else MISSING

    def _cell(self, key: Key) -> tuple[int, int]:
        """The (layer position, expert) index of the dense state."""
        return self._layer_pos[key[0]], key[1]

    def _score(self, key: Key) -> float:
        """The decayed routing count of `key` now."""
        return float(self._raw[self._cell(key)]) / self._gain

    def _coldest(self) -> Key | None:
        """The cached (not pinned) slot with the lowest score, or None."""
        if not self._cached.any():
            return None
        cell = int(np.where(self._cached, self._raw, np.inf).argmin())
        return self._layers[cell // self.num_experts], cell % self.num_experts

    def _renormalize(self) -> None:
        """Fold the gain into the raw counts (before it overflows)."""
        self._raw /= self._gain
        self._gain = 1.0

    def _point(self, key: Key, entry: int) -> None:
        layer, expert = key
        pos = self._layer_pos[layer]
        self._tables[layer][expert] = entry
        self._entries[pos, expert] = entry
        if self._shared:  # a launched step's record holds the array: it keeps the table its router saw
            self._slotted, self._shared = self._slotted.copy(), False
        self._slotted[pos, expert] = entry >= 0
