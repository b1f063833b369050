"""The expert slab: VRAM expert slots leased from the arena, and the pointer table.

Implements the model's `ExpertSource`. For every routed layer `table(layer)[e]`
says where expert e's weights are right now:

    entry >= 0   slot `entry`: row `entry` of `slab` (the arena's pages as [P, 3*I*H], or as
                 [P, extent bytes] uint8 for compact experts: `weight_format`), or
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
re-read, never data), down to the arena policy's floor. Between steps `rebalance`
admits hot host experts into free pages, or in place of a colder slot. Which
ones is `SlotPolicy`'s choice (policy.py: decayed routing frequency with
admission control); the slab applies its decisions.

Disk tier (`--weights-disk-tier`): experts whose home is the model file have
no host row. When a step's router sends tokens to one without a slot,
`prepare` reads it into the layer's disk buffer (disk_buffers.py) and points
the table there until the step ends.

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
a record holds it. `count` hands the routing to `RoutingTally` (routing.py:
the per-layer stats and per-sequence counts), and what it routed to the policy
(`SlotPolicy.observe`: the scores and the next rebalance's candidates).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from radianced.arena import EXPERTS, Arena, Lease, OutOfPages
from radianced.tiers.disk_buffers import DiskBuffers
from radianced.tiers.expert_loader import ExpertLoader
from radianced.tiers.placement import CARD, DISK, HOST, Key, Placement
from radianced.tiers.policy import MAX_REFILLS, SlotPolicy
from radianced.tiers.routing import ExpertCounts, Recording, RoutingTally, SlabStats, StepRecord
from radianced.tiers.routing_buffers import RoutingBuffers

log = logging.getLogger("radianced.experts")

MISSING = -(1 << 62)  # table entry of a disk-homed expert without a slot (out of every tensor's range)

# one routed layer's call of a step: (layer, ids [T, k], which experts were in a slot when its router ran
# ([E] bool, taken before the disk tier staged any), or None: the table as it is at end_launch, unchanged
# during the step without a disk tier)
Recorded = tuple[int, torch.Tensor, "np.ndarray | None"]


class SlabError(RuntimeError):
    """The slots cannot be filled at start (a pinned or pre-filled expert failed to read)."""


class ExpertSlab:
    def __init__(self, arena: Arena, width: int, dtype: torch.dtype, placement: Placement,
                 host: torch.Tensor | None, loader: ExpertLoader | None, num_experts: int,
                 max_slots: int | None = None, formats: dict[int, str] | None = None,
                 owned: tuple[int, int] | None = None, staging_rows: int = 0):
        """width: elements of one expert extent (the widest); dtype: the extents' (uint8 for compact
        ones); host: [placement.count(HOST), width] rows in placement.host_row order; loader: reads
        extents from the model file into slab rows (the pinned experts, disk-homed ones; needed when
        the placement has any); max_slots: --expert-slots (None: as many as the arena lends);
        formats: per routed layer, its extents' format when they are compact (`weight_format`);
        owned: (first, stop), the expert ids of a card's share under --tp (the placement's are
        among them; the other ids' table entries stay MISSING, and only these are counted);
        staging_rows: the card's rows for a MoE call's host-pool misses (`Receipt.miss_staging`: GGUF
        experts with a host pool; kernels/stage.py), each an extent in whole 16-byte words.
        Leases and fills every start slot."""
        _check_homes(arena, placement, loader)
        self.arena, self.placement, self.host, self.loader = arena, placement, host, loader
        self._formats = formats or {}
        self.slab = arena.paged_view(dtype, (width,))  # [P + reserved, width]
        self.max_slots, self.num_experts = max_slots, num_experts
        self.extent_bytes = width * dtype.itemsize  # what one overflow read moves over the link
        self.staging = torch.empty((staging_rows, (self.extent_bytes + 15) // 16 * 16), dtype=torch.uint8,
                                   device=self.slab.device) if staging_rows else None
        layers = sorted({layer for layer, _ in placement.pinned + placement.host + placement.disk})
        self._layers = tuple(layers)
        self._layer_pos = {layer: i for i, layer in enumerate(layers)}
        self.owned = owned
        self._tables = {layer: torch.full((num_experts,), MISSING, dtype=torch.int64, device=self.slab.device)
                        for layer in layers}
        # Dense [routed layer position, expert] copies of the tables on the host: their contents
        # (readable without a device sync) and which experts sit in any slot (entry >= 0: what a
        # hit is judged by; shared with a launched step's record until the next patch copies it).
        shape = (len(layers), num_experts)
        self._entries = np.full(shape, MISSING, dtype=np.int64)
        self._slotted = np.zeros(shape, dtype=bool)
        self._shared = False  # a launched step's record holds _slotted: patch a copy
        for key in placement.host + placement.disk:
            self._point(key, self._home_entry(key))
        self._pinned = frozenset(placement.pinned)
        self._slot_of: dict[Key, int] = {}
        self.stats = SlabStats(layers)
        self.tally = RoutingTally(self.stats, num_experts, owned)  # counts each step's routing
        self.policy = SlotPolicy(layers, num_experts)  # chooses the cached slots' experts
        self._disk = DiskBuffers(arena.reserved, self.slab, loader, self.stats)  # a step's disk-homed experts
        self._recorded: list[Recorded] = []  # this step's routing, counted by end_step
        self._replayed: Recording | None = None  # or this step's, as a graph replay left it (replay)
        self._copies = RoutingBuffers(self.slab.device.type == "cuda")  # the steps' routing on the host
        self._segments: list[tuple[int, int]] = []  # row ranges counted apart (begin_step)
        self._num_rows = 0
        self._fill_start()
        arena.register(EXPERTS, self)

    # -- ExpertSource ------------------------------------------------------------

    @property
    def stages_experts(self) -> bool:
        """Whether `prepare` reads routed experts in: with disk homes."""
        return bool(self.placement.disk)

    def table(self, layer: int) -> torch.Tensor:
        return self._tables[layer]

    def weight_format(self, layer: int) -> str | None:
        return self._formats.get(layer)

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
        if self.owned is not None:  # a card's share (--tp): the MoE runs the other cards' assignments on
            first, stop = self.owned  # the first expert it owns, at weight 0 (model/layers.py)
            routed = sorted({e if first <= e < stop else first for e in routed})
        missing = [e for e in routed if entries[e] == MISSING]
        if missing:
            for key, row in self._disk.stage(layer, self._layer_pos[layer], missing, expert_ids):
                self._point(key, row)

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
        self._disk.begin_step()
        self._recorded, self._replayed = [], None
        self._segments, self._num_rows = list(segments), num_rows

    def end_step(self) -> tuple[ExpertCounts, ...]:
        """`count(end_launch())`: the step's counts, waiting for its routing."""
        return self.count(self.end_launch())

    def end_launch(self) -> StepRecord:
        """After a forward is queued: take its routing record (the ids go to the host with a queued
        copy, not waited for) and end the step's recording. Disk experts read for the step stop
        being addressable (their buffer rows are reused). Call once after each forward."""
        staged, failed_rows, errors = self._disk.end_step()
        for key in staged:
            self._point(key, MISSING)
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
        record = StepRecord(layers, pos, slotted, buffer, self._num_rows, self._segments, failed_rows, errors)
        self._segments = []
        return record

    def count(self, record: StepRecord) -> tuple[ExpertCounts, ...]:
        """Count a launched step (per layer; scores; its segments, summed over layers) once its
        routing copy is done (waits for it); returns the segments' counts. Steps are counted in
        launch order, each once: its host buffer then goes back to be reused."""
        buffer = record.buffer
        if buffer is None:
            return ((0, 0, 0, 0),) * len(record.segments)
        buffer.wait()
        counts, routed = self.tally.count(record, buffer.array[:record.rows])
        self.policy.observe(routed)
        record.buffer = None
        self._copies.give(buffer)
        return counts

    @property
    def routing(self) -> dict[Key, int]:
        """Token-to-expert assignments since start, per (layer, expert) routed at least once."""
        return self.tally.routing

    def reset_counts(self) -> None:
        """Count lookups, hits and routing from zero (after the daemon's warm-up: its random prompts are
        not served traffic, and the saved expert profile must not learn them)."""
        self.stats.reset()
        self.tally.restart()

    # -- the arena's reclaimer -----------------------------------------------------

    def surrenderable(self) -> int:
        """Slots `surrender` could give up now (the cached ones; pinned experts stay)."""
        return len(self._slot_of) - len(self._pinned)

    def reclaim_cost(self) -> float:
        """Cost per byte of giving up a slot: re-reading the coldest expert over the link,
        weighted by how hot it still is (KV blocks are compared with recompute cost)."""
        cold = self.policy.coldest()
        return self.policy.score(cold) + 1.0 if cold else float("inf")

    def surrender(self, n: int) -> Lease:
        """Give up to n cached (non-pinned) slots, coldest first; their table entries point
        back at their homes before the pages leave. No fence: the table patches, and whatever
        the pages' next tenant writes into them, are queued on the stream behind the steps
        already launched, so those steps read the old rows first (on the CPU a launched step's
        ops have already run)."""
        return Lease(EXPERTS, tuple(self._evict(key) for key in self.policy.victims(n)))

    def give_up(self, pages: Sequence[int]) -> Lease:
        """Give up the cached slots in `pages` (their experts point back at their homes): another's
        choice (--tp: rank 0's KV took these pages, engine/tp_pages.py). Raises ValueError, changing
        nothing, where a page holds no cached slot."""
        cached = {page: key for key, page in self._slot_of.items() if key not in self._pinned}
        if not set(pages) <= cached.keys():
            raise ValueError(f"pages {sorted(set(pages) - cached.keys())} hold no cached expert slot")
        for p in pages:
            self.policy.slot_lost(cached[p])
        return Lease(EXPERTS, tuple(self._evict(cached[p]) for p in pages))

    # -- between steps -------------------------------------------------------------

    def rebalance(self, max_refills: int = MAX_REFILLS) -> int:
        """Decay scores, then refill the slots the policy chooses (`SlotPolicy.rebalance`: the
        hottest experts the last step missed, into free pages the arena lends, else in place of
        a colder cached slot). Returns refills."""
        admitted: list[tuple[Key, int]] = []
        for a in self.policy.rebalance(self._slotted, self._lease_one, max_refills):
            # a victim's page stays ours: refilled in place, in stream order
            admitted.append((a.key, a.page if a.victim is None else self._evict(a.victim)))
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

    def slot_pages(self) -> dict[Key, int]:
        """Each slotted expert's slot (arena page)."""
        return dict(self._slot_of)

    # -- internals -----------------------------------------------------------------

    def _fill_start(self) -> None:
        """Lease and fill the start slots (pinned experts, then the pre-fill in rank order)."""
        start = self.placement.pinned + self.placement.prefill
        t0 = time.perf_counter()
        pages = self.arena.lease(EXPERTS, len(start)).pages
        failed = self._fill_many(list(zip(start, pages)))
        if failed:
            raise SlabError(f"cannot fill the expert slots at start: {failed[0]}"
                            + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""))
        self.fill_seconds = time.perf_counter() - t0
        if self.loader is not None:
            self.loader.drain_latencies()  # the start fill is not the disk tier's traffic

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
        if key not in self._pinned:
            self.policy.slot_taken(key)

    def _evict(self, key: Key) -> int:
        """Take `key` (a victim the policy named) out of its slot; returns the slot's page."""
        page = self._slot_of.pop(key)
        self._point(key, self._home_entry(key))
        self.stats.evictions += 1
        return page

    def _home_entry(self, key: Key) -> int:
        """The table entry of an expert without a slot: its host row, or MISSING (disk home)."""
        home = self.placement.home(*key)
        if home == CARD:
            raise ValueError(f"expert (layer {key[0]}, expert {key[1]}) is pinned on the card: it always has a slot")
        return -1 - self.placement.host_row(*key) if home == HOST else MISSING

    def _point(self, key: Key, entry: int) -> None:
        layer, expert = key
        pos = self._layer_pos[layer]
        self._tables[layer][expert] = entry
        self._entries[pos, expert] = entry
        if self._shared:  # a launched step's record holds the array: it keeps the table its router saw
            self._slotted, self._shared = self._slotted.copy(), False
        self._slotted[pos, expert] = entry >= 0


def _check_homes(arena: Arena, placement: Placement, loader: ExpertLoader | None) -> None:
    """Raise ValueError when the placement needs a loader or disk buffers the slab was not given."""
    if (placement.pinned or placement.disk) and loader is None:
        raise ValueError("experts pinned on the card or homed on disk are read from the file: give a loader")
    if placement.disk and len(arena.reserved) < 2:
        raise ValueError(f"{len(placement.disk)} experts have their home on disk, and the arena has no "
                         f"reserved pages for the disk tier's buffers (a receipt with --weights-disk-tier)")
