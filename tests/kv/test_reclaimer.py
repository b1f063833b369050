"""The KV tenant inside the arena: a block allocator over `TenantPages`, its `KVReclaimer`, and an
expert tenant lending it pages. Exact page and block ids."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radianced.arena import EXPERTS, KV, Arena, FixedPolicy, Lease, LendingPolicy, OutOfPages, TenantPages
from radianced.kv.blocks import BlockAllocator, OutOfBlocks
from radianced.kv.prefix import PrefixCache, extend_block_hashes
from radianced.kv.reclaimer import KVReclaimer
from radianced.tiers.placement import place
from radianced.tiers.slab import ExpertSlab

BS, PER_PAGE = 4, 4  # tokens a block, blocks a page


class Slots:
    """Expert slots at one cost each, coldest (oldest) given up first."""

    def __init__(self, arena: Arena, cost: float):
        self.arena, self.cost, self.pages = arena, cost, []
        arena.register(EXPERTS, self)

    def take(self, n: int) -> None:
        self.pages += self.arena.lease(EXPERTS, n).pages

    def reclaim_cost(self) -> float:
        return self.cost if self.pages else math.inf

    def surrenderable(self) -> int:
        return len(self.pages)

    def surrender(self, n: int) -> Lease:
        give, self.pages = self.pages[:n], self.pages[n:]
        return Lease(EXPERTS, tuple(give))


def kv_and_slots(pages: int, slot_cost: float, cache: bool = False):
    arena = Arena(pages, 4096, policy=LendingPolicy())
    alloc = BlockAllocator(BS, TenantPages(arena, KV), {"kv_attn": PER_PAGE})
    prefix = PrefixCache(alloc) if cache else None
    arena.register(KV, KVReclaimer(alloc))
    return arena, alloc, prefix, Slots(arena, slot_cost)


def test_kv_grows_past_its_empty_pages_with_pages_taken_from_the_slots():
    """The H200 crash of 2026-12-04 (`kv_attn: asked for 15 blocks, 12 free`): KV's pages were its
    own cheapest victim, so the lease took back one of its empty pages and handed it back as new."""
    arena, alloc, _, slots = kv_and_slots(pages=8, slot_cost=2.0)
    table = alloc.new_table()
    alloc.append(table, 12 * BS)  # pages 0..2
    alloc.free(table)  # three empty pages: 12 free blocks the pool counts
    slots.take(5)  # every other page
    assert alloc.can_allocate(15)
    blocks = alloc.allocate(15)
    assert len(blocks) == 15 and arena.held(KV) == 4 and slots.pages == [4, 5, 6, 7]
    assert dict(arena.stats().moved) == {(EXPERTS, KV): 1}


def test_kv_takes_free_pages_then_evicts_its_own_cached_blocks_before_taking_dearer_slots():
    arena, alloc, prefix, slots = kv_and_slots(pages=5, slot_cost=2.0, cache=True)
    tokens = list(range(8 * BS))
    table = alloc.new_table()
    alloc.append(table, len(tokens))  # pages 0, 1
    hashes = extend_block_hashes([], tokens, BS)
    prefix.insert(table, hashes, 0, len(hashes))
    alloc.free(table)  # 8 cached blocks, all evictable
    slots.take(2)
    assert arena.cheapest_other(KV) == 2.0  # dearer than a recompute: KV recycles first
    alloc.allocate(6)  # the free page 4, then 2 cached blocks evicted
    assert (prefix.evictable(), slots.pages, arena.held(KV)) == (6, [2, 3], 3)
    alloc.allocate(6)  # 6 more evicted; no slot taken
    assert (prefix.evictable(), slots.pages, arena.held(KV)) == (0, [2, 3], 3)
    alloc.allocate(4)  # now a slot
    assert (slots.pages, arena.held(KV)) == ([3], 4)


def test_cheaper_slots_go_before_kv_evicts_its_cache():
    arena, alloc, prefix, slots = kv_and_slots(pages=4, slot_cost=0.5, cache=True)
    tokens = list(range(8 * BS))
    table = alloc.new_table()
    alloc.append(table, len(tokens))
    hashes = extend_block_hashes([], tokens, BS)
    prefix.insert(table, hashes, 0, len(hashes))
    alloc.free(table)
    slots.take(2)
    assert arena.cheapest_other(KV) == 0.5  # cheaper than a recompute
    alloc.allocate(12)  # 8 blocks from both slots' pages, then 4 evicted
    assert (prefix.evictable(), slots.pages, arena.held(KV)) == (4, [], 4)
    with pytest.raises(OutOfBlocks):
        alloc.allocate(5)
    assert prefix.evictable() == 4  # all or nothing


def test_the_slots_take_kv_pages_no_live_request_holds():
    arena, alloc, _, slots = kv_and_slots(pages=4, slot_cost=2.0)
    live = alloc.new_table()
    alloc.append(live, 4 * BS)  # page 0
    idle = alloc.new_table()
    alloc.append(idle, 4 * BS)  # page 1
    alloc.free(idle)
    slots.take(3)  # the free pages 2, 3 and KV's empty page 1, lowest first
    assert slots.pages == [1, 2, 3] and arena.held(KV) == 1 and alloc.pools[0].pages == {0}
    with pytest.raises(OutOfPages):
        slots.take(1)  # page 0 holds a live request's blocks
    assert dict(arena.stats().moved) == {(KV, EXPERTS): 1}


def test_kv_evicts_a_lone_cached_block_rather_than_take_a_slot():
    """Fewer evictable blocks than a page holds: KV has no page to give another tenant, but evicting
    its cached block covers its own allocation at a recompute's cost (review of 4d73909)."""
    arena, alloc, prefix, slots = kv_and_slots(pages=3, slot_cost=2.0, cache=True)
    live = alloc.new_table()
    alloc.append(live, 2 * BS)  # blocks 0, 1 of page 0
    idle = alloc.new_table()
    alloc.append(idle, BS)  # block 2
    prefix.insert(idle, extend_block_hashes([], list(range(BS)), BS), 0, 1)
    alloc.free(idle)
    slots.take(2)
    alloc.allocate(2)  # block 3, then the cached block 2
    assert (prefix.evictable(), slots.pages, dict(arena.stats().moved)) == (0, [1, 2], {})


def test_no_cached_block_is_evicted_that_saves_no_page():
    arena, alloc, prefix, slots = kv_and_slots(pages=4, slot_cost=2.0, cache=True)
    tokens = list(range(5 * BS))
    cached = alloc.new_table()
    alloc.append(cached, len(tokens))  # blocks 0..4: page 0 and one block of page 1
    hashes = extend_block_hashes([], tokens, BS)
    prefix.insert(cached, hashes, 0, 5)
    alloc.free(cached)
    alloc.append(alloc.new_table(), 3 * BS)  # blocks 5..7, live
    slots.take(2)
    assert (alloc.pools[0].num_free, prefix.evictable()) == (0, 5)
    # 10 blocks: the pages needed fall 3, 3, 2, 2, 2, 2 as 0..5 are evicted: 2 evicted, both slots taken
    alloc.allocate(10)
    assert (prefix.evictable(), slots.pages, alloc.pools[0].num_free) == (3, [], 0)


SETUP = st.tuples(st.booleans(), st.integers(4, 14), st.integers(0, 12), st.integers(0, 4),
                  st.dictionaries(st.sampled_from(["a", "b"]), st.integers(1, 8), min_size=1))
OPS = st.lists(st.tuples(st.sampled_from(["alloc", "max", "append", "free", "cache", "route", "release"]),
                         st.integers(0, 40), st.integers(0, 10_000)), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(SETUP, OPS)
def test_can_allocate_predicts_allocate_beside_a_real_slab(setup, ops):
    """Random allocations, appends, frees (cached or not), routed steps and page releases against a real
    arena and expert slab: can_allocate / can_append predict their verb, a refusal changes nothing, and
    in lending mode no slot is taken that evicting KV's own cached blocks could have spared."""
    fixed, pages, slots_n, floor, groups = setup
    slots_n, layers, experts = min(slots_n, pages - 1), 2, 6
    policy = FixedPolicy(((EXPERTS, slots_n), (KV, pages - slots_n))) if fixed else \
        LendingPolicy(expert_floor=min(floor, slots_n))
    arena = Arena(pages, 4096, policy=policy)
    keys = [(lay, e) for lay in range(layers) for e in range(experts)]
    slab = ExpertSlab(arena, 1024, torch.float32, place(keys, pinned=0, host=len(keys), disk=0, slots=slots_n),
                      torch.zeros(len(keys), 1024), None, experts)
    alloc = BlockAllocator(BS, TenantPages(arena, KV), groups)
    prefix = PrefixCache(alloc)
    arena.register(KV, KVReclaimer(alloc))
    tokens = itertools.count(1_000_000)
    rng = np.random.default_rng(0)
    tables = []

    def state():
        return arena.stats(), [(p.free_blocks(), p.pages) for p in alloc.pools], prefix.evictable(), slab.num_slots

    for op, a, b in ops:
        if op in ("alloc", "max") or op == "append" and tables:
            table, toks = (alloc.new_table(), []) if op != "append" else tables[b % len(tables)]
            n = a % 12 + 1 if op != "max" else alloc.num_allocatable() or 1
            want = len(toks) + n * BS
            can, before = alloc.can_append(table, want), state()
            spare = alloc._pages_needed(n, alloc.evictable()) - arena.usable(KV)  # slots it must take
            try:
                alloc.append(table, want)
            except OutOfBlocks:
                assert not can and state() == before
                continue
            assert can
            if not fixed and op != "append":
                assert before[3] - slab.num_slots <= max(0, spare)
            toks += [next(tokens) for _ in range(want - len(toks))]
            if op != "append":
                tables.append((table, toks))
        elif op in ("free", "cache") and tables:
            table, toks = tables.pop(b % len(tables))
            if op == "cache":
                hashes = extend_block_hashes([], toks, BS)
                prefix.insert(table, hashes, 0, len(hashes))
            alloc.free(table)
        elif op == "route":
            slab.begin_step([(0, 1)], 1)
            for layer in range(layers):
                slab.prepare(layer, torch.from_numpy(rng.choice(experts, size=2, replace=False)).unsqueeze(0))
            slab.end_step()
            slab.rebalance()
        elif op == "release":
            alloc.release_pages()
        assert arena.held(KV) == sum(len(p.pages) for p in alloc.pools)
