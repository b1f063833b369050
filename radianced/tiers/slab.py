"""The expert slab: VRAM expert slots leased from the arena, and the pointer table.

Implements the model's `ExpertSource`. For every routed layer `table(layer)[e]`
says where expert e's weights are right now:

    entry >= 0   slot `entry`: row `entry` of `slab` (the arena's pages as [P, 3*I*H])
    entry <  0   host row `-1 - entry` of `host` (the pinned host pool: an overflow read)

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

Policy: frequency with exponential decay over steps (`DECAY` per step). Pure
LRU thrashes when a step routes more distinct experts than there are slots;
profile-static never adapts to the traffic; decayed counts keep the experts
that keep being routed and forget a burst within a few dozen steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from radianced.arena import EXPERTS, PASSED, Arena, Fence, Lease, OutOfPages
from radianced.tiers.placement import Key, Placement

DECAY = 0.9  # per step: a count halves in about 7 steps
MAX_REFILLS = 8  # slots refilled per rebalance: bounds the copy work between steps


@dataclass
class SlabStats:
    """Per-layer expert lookups since start: one lookup per (step, layer, distinct expert)."""

    lookups: dict[int, int]
    hits: dict[int, int]
    routed: dict[int, int]  # token-to-expert assignments
    refills: int = 0
    evictions: int = 0

    @property
    def total_lookups(self) -> int:
        return sum(self.lookups.values())

    @property
    def total_hits(self) -> int:
        return sum(self.hits.values())


ExpertCounts = tuple[int, int, int, int]  # (lookups, hits, routed, routed_from_misses) of one sequence


class ExpertSlab:
    def __init__(self, arena: Arena, width: int, dtype: torch.dtype, placement: Placement,
                 host: torch.Tensor | None, load: Callable[[Key], torch.Tensor], num_experts: int,
                 max_slots: int | None = None):
        """width: elements of one expert extent; host: [placement.count(HOST), width] rows in
        placement.host_row order; load((layer, expert)) -> the extent [width] from its home
        (file or host row), used to fill pinned slots; max_slots: --expert-slots (None: as many
        as the arena lends). Leases and fills every start slot."""
        if placement.disk:
            raise ValueError(f"{len(placement.disk)} experts have their home on disk: the disk tier "
                             f"is not wired into the slab yet; give a larger --host-pool-mib")
        self.arena, self.placement, self.host = arena, placement, host
        self.slab = arena.paged_view(dtype, (width,))  # [P, width]
        self._load = load
        self.max_slots = max_slots
        layers = sorted({layer for layer, _ in placement.pinned + placement.host})
        self._tables = {layer: torch.empty(num_experts, dtype=torch.int64, device=self.slab.device)
                        for layer in layers}
        for key in placement.host:
            self._point(key, -1 - placement.host_row(*key))
        self._pinned = frozenset(placement.pinned)
        self._slot_of: dict[Key, int] = {}
        self._score: dict[Key, float] = {}
        # exact token-to-expert assignments since start: what a profile counts (`_score` decays)
        self.routing: dict[Key, int] = {}
        self.stats = SlabStats({l: 0 for l in layers}, {l: 0 for l in layers}, {l: 0 for l in layers})
        self.num_experts = num_experts
        self.extent_bytes = width * dtype.itemsize  # what one overflow read moves over the link
        self._row_seq: torch.Tensor | None = None  # [T]: the step's counted segment of each row, -1 if none
        self._seq_counts: torch.Tensor | None = None  # [segments, 4]: ExpertCounts being summed over layers
        start = placement.pinned + placement.prefill
        pages = arena.lease(EXPERTS, len(start)).pages
        for key, page in zip(start, pages):
            self._fill(key, page)
        arena.register(EXPERTS, self)

    # -- ExpertSource ------------------------------------------------------------

    def table(self, layer: int) -> torch.Tensor:
        return self._tables[layer]

    def prepare(self, layer: int, expert_ids: torch.Tensor) -> None:
        """Count the step's routing of `layer` (lookups, hits, scores). Host-resident experts
        are read in place by the MoE (overflow), so nothing has to move before it runs."""
        experts, counts = torch.unique(expert_ids, return_counts=True)
        table = self._tables[layer]
        hits = int((table[experts] >= 0).sum())  # deliberate host sync: the CPU path's accounting
        self.stats.lookups[layer] += len(experts)
        self.stats.hits[layer] += hits
        self.stats.routed[layer] += int(counts.sum())
        for e, c in zip(experts.tolist(), counts.tolist()):
            self._score[(layer, e)] = self._score.get((layer, e), 0.0) + c
            self.routing[(layer, e)] = self.routing.get((layer, e), 0) + c
        if self._row_seq is not None:
            self._count_segments(table, expert_ids)

    # -- per-sequence accounting (SPEC §9: the per-request line) -------------------

    def begin_step(self, segments: Sequence[tuple[int, int]], num_rows: int) -> None:
        """Before a forward of `num_rows` token rows: count the routing of each segment
        (start, end) of rows apart (one segment per counted sequence) until `end_step`.
        A lookup is one (layer, expert) a segment's rows needed this step, a hit found it
        in a slot at that time; two segments needing one expert each count it."""
        if not segments:
            self._row_seq = self._seq_counts = None
            return
        row_seq = torch.full((num_rows,), -1, dtype=torch.int64)
        for i, (start, end) in enumerate(segments):
            row_seq[start:end] = i
        self._row_seq = row_seq.to(self.slab.device)
        self._seq_counts = torch.zeros((len(segments), 4), dtype=torch.int64, device=self.slab.device)

    def end_step(self) -> tuple[ExpertCounts, ...]:
        """The counts of each segment given to `begin_step` (summed over layers); stops counting."""
        counts = self._seq_counts
        self._row_seq = self._seq_counts = None
        return () if counts is None else tuple(tuple(row) for row in counts.tolist())

    def _count_segments(self, table: torch.Tensor, expert_ids: torch.Tensor) -> None:
        """Add this layer's (lookups, hits, routed, routed_from_misses) of each segment."""
        k = expert_ids.shape[1]
        seg = self._row_seq.unsqueeze(1).expand(-1, k).reshape(-1)
        ids = expert_ids.reshape(-1).to(torch.int64)
        keep = seg >= 0
        pairs, routed = torch.unique(seg[keep] * self.num_experts + ids[keep], return_counts=True)
        seq, hit = pairs // self.num_experts, table[pairs % self.num_experts] >= 0
        counts = self._seq_counts
        counts[:, 0].index_add_(0, seq, torch.ones_like(seq))
        counts[:, 1].index_add_(0, seq, hit.to(torch.int64))
        counts[:, 2].index_add_(0, seq, routed)
        counts[:, 3].index_add_(0, seq, routed * ~hit)

    # -- the arena's reclaimer -----------------------------------------------------

    def surrenderable(self) -> int:
        """Slots `surrender` could give up now (the cached ones; pinned experts stay)."""
        return len(self._slot_of) - len(self._pinned)

    def reclaim_cost(self) -> float:
        """Cost per byte of giving up a slot: re-reading the coldest expert over the link,
        weighted by how hot it still is (KV blocks are compared with recompute cost)."""
        cold = self._coldest(1)
        return self._score.get(cold[0], 0.0) + 1.0 if cold else float("inf")

    def surrender(self, n: int) -> tuple[Lease, Fence]:
        """Give up to n cached (non-pinned) slots, coldest first; their table entries point
        back at the host pool before the pages leave."""
        victims = self._coldest(n)
        pages = tuple(self._evict(key) for key in victims)
        return Lease(EXPERTS, pages), PASSED  # CPU: no queued step reads the old rows

    # -- between steps -------------------------------------------------------------

    def rebalance(self, max_refills: int = MAX_REFILLS) -> int:
        """Decay scores, then admit the hottest host experts without a slot: into free
        pages the arena lends, else in place of a colder cached slot. Returns refills."""
        for key in self._score:
            self._score[key] *= DECAY
        candidates = sorted((k for k in self._score if k not in self._slot_of and self._score[k] > 0.5),
                            key=lambda k: -self._score[k])
        refills = 0
        for key in candidates[:max_refills]:
            page = self._lease_one()
            if page is None:
                cold = self._coldest(1)
                if not cold or self._score.get(cold[0], 0.0) >= self._score[key]:
                    break
                page = self._evict(cold[0])  # the page stays ours: refilled in place (CPU: nothing queued reads it)
            self._fill(key, page)
            refills += 1
        self.stats.refills += refills
        return refills

    @property
    def num_slots(self) -> int:
        return len(self._slot_of)

    def slotted(self) -> frozenset[Key]:
        return frozenset(self._slot_of)

    # -- internals -----------------------------------------------------------------

    def _lease_one(self) -> int | None:
        """A page from the arena (free, or taken back from idle KV), or None if the policy says no."""
        if self.arena.available(EXPERTS) == 0 or self.max_slots is not None and self.num_slots >= self.max_slots:
            return None
        try:
            return self.arena.lease(EXPERTS, 1).pages[0]
        except OutOfPages:  # what KV gave back stays in its buffer of free pages
            return None

    def _fill(self, key: Key, page: int) -> None:
        src = self._load(key) if key in self._pinned else self.host[self.placement.host_row(*key)]
        self.slab[page].copy_(src)
        self._slot_of[key] = page
        self._point(key, page)

    def _evict(self, key: Key) -> int:
        page = self._slot_of.pop(key)
        self._point(key, -1 - self.placement.host_row(*key))
        self.stats.evictions += 1
        return page

    def _coldest(self, n: int) -> list[Key]:
        cached = [k for k in self._slot_of if k not in self._pinned]
        return sorted(cached, key=lambda k: self._score.get(k, 0.0))[:n]

    def _point(self, key: Key, entry: int) -> None:
        layer, expert = key
        self._tables[layer][expert] = entry
