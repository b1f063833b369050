"""The KV tenant inside the arena: a block allocator over `TenantPages`, its `KVReclaimer`, and an
expert tenant lending it pages. Exact page and block ids."""

from __future__ import annotations

import math

import pytest

from radianced.arena import EXPERTS, KV, Arena, Lease, LendingPolicy, OutOfPages, TenantPages
from radianced.kv.blocks import BlockAllocator, OutOfBlocks
from radianced.kv.prefix import PrefixCache, extend_block_hashes
from radianced.kv.reclaimer import KVReclaimer

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
    assert arena.recycles_first(KV)
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
    assert not arena.recycles_first(KV)
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
