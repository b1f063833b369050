"""The scheduler's KV books: prefix hits acquired before fresh blocks, what a start may take,
recurrent-state slots and checkpoints (taken, saved, handed to the prefix cache or freed)."""

from __future__ import annotations

from radianced.engine.kv_manager import KVManager
from radianced.engine.plan import StepPlan
from radianced.engine.request import Request, Sequence
from radianced.kv.blocks import BlockAllocator
from radianced.kv.prefix import PrefixCache, PrefixMatch
from radianced.kv.state import CheckpointSlots, StateCopy, StateSlots

BS = 4


def seq(seq_id: int, prompt) -> Sequence:
    return Sequence(seq_id, Request(f"r{seq_id}", tuple(prompt), None))


def computed(kv: KVManager, s: Sequence, tokens: int) -> None:
    """As the scheduler's update() would: `tokens` tokens have KV, full blocks go to the cache."""
    s.num_computed_tokens = tokens
    kv.cache_blocks(s, tokens)


def test_a_start_acquires_the_prefix_hit_then_fresh_blocks_and_release_gives_all_back():
    alloc = BlockAllocator.fixed(16, BS)
    cache = PrefixCache(alloc)
    kv = KVManager(alloc, cache, None)
    a = seq(0, range(10))
    assert kv.match(a) == PrefixMatch() and kv.can_start(PrefixMatch(), 10)
    assert kv.start(a, PrefixMatch(), 10) == []
    assert (a.block_table.ids(), a.num_cached_blocks, a.state_slot) == ((0, 1, 2), 0, None)
    computed(kv, a, 10)
    assert (a.num_cached_blocks, cache.num_cached) == (2, 2)  # the partial third block is not cached
    kv.release(a, [])
    assert (len(a.block_table), alloc.num_used, cache.evictable()) == (0, 0, 2)

    b = seq(1, [*range(10), 50, 51])
    m = kv.match(b)
    assert m == PrefixMatch(blocks=((0,), (1,)), num_tokens=8, num_evictable=2)
    assert kv.start(b, m, 12) == []
    assert (b.block_table.ids(), b.num_cached_blocks) == ((0, 1, 2), 2)
    assert [alloc.ref_count((i,)) for i in range(3)] == [2, 2, 1]
    assert cache.evictable() == 0


def test_can_start_does_not_count_the_blocks_of_its_own_match_as_evictable():
    alloc = BlockAllocator.fixed(3, BS)
    kv = KVManager(alloc, PrefixCache(alloc), None)
    a = seq(0, range(8))
    kv.start(a, PrefixMatch(), 8)
    computed(kv, a, 8)
    kv.release(a, [])  # blocks 0 1 idle in the cache, block 2 never leased
    m = kv.match(seq(1, [*range(8), 9, 9, 9, 9, 9]))  # 13 tokens: 4 blocks, 2 of them matched
    assert (len(m.blocks), m.num_evictable) == (2, 2)
    assert not kv.can_start(m, 13)  # 2 fresh blocks needed, 1 left once the match is held
    assert kv.can_start(m, 12)


def test_without_a_hybrid_prefix_cache_no_checkpoint_is_planned():
    alloc = BlockAllocator.fixed(8, BS)
    for kv in (KVManager(alloc, None, None), KVManager(alloc, None, StateSlots(2))):
        s = seq(0, range(10))
        assert kv.checkpoint_at(s, 0) == 0
        assert kv.checkpoint_saves(s, 8, sample=True) == []
    kv = KVManager(alloc, None, StateSlots(2))
    s = seq(1, range(5))
    assert kv.start(s, PrefixMatch(), 5) == [StateCopy.reset(0)]  # hybrid without a cache: a slot, no save


def test_hybrid_checkpoints_are_saved_at_block_boundaries_and_handed_over_unless_a_save_is_in_flight():
    alloc = BlockAllocator.fixed(16, BS)
    ckpts, slots = CheckpointSlots(2), StateSlots(2)
    cache = PrefixCache(alloc, hybrid=True, checkpoints=ckpts)
    kv = KVManager(alloc, cache, slots)
    a = seq(0, range(10))
    a.checkpoint_at = kv.checkpoint_at(a, 0)
    assert a.checkpoint_at == 8  # the prompt's last block boundary: a later request computes token 9 on
    assert kv.start(a, PrefixMatch(), 8) == [StateCopy.reset(0)] and a.state_slot == 0
    assert kv.checkpoint_saves(a, 6, sample=True) == []  # not at a block boundary
    assert kv.checkpoint_saves(a, 4, sample=False) == []  # a boundary, but neither the prompt's nor a sample
    assert kv.checkpoint_saves(a, 8, sample=False) == [StateCopy.save(0, 0)] and a.checkpoint == 0
    computed(kv, a, 8)
    a.checkpoint_tokens = 8
    kv.hand_over_checkpoint(a, [StepPlan(after=(StateCopy.save(0, 0),))])  # still being written: freed
    assert (a.checkpoint, cache.num_checkpoints, ckpts.num_free) == (None, 0, 2)

    assert kv.checkpoint_saves(a, 8, sample=False) == [StateCopy.save(0, 0)]
    a.checkpoint_tokens = 8
    kv.hand_over_checkpoint(a, [])
    assert (a.checkpoint, cache.num_checkpoints, ckpts.num_free) == (None, 1, 1)
    kv.release(a, [])
    assert (a.state_slot, slots.num_free, cache.evictable()) == (None, 2, 2)

    b = seq(1, range(10))
    m = kv.match(b)
    assert m == PrefixMatch(blocks=((0,), (1,)), num_tokens=8, checkpoint=0, num_evictable=2)
    assert kv.checkpoint_at(b, m.num_tokens) == 0  # the hit already ends there
    assert kv.start(b, m, 10) == [StateCopy.restore(0, 0)]
