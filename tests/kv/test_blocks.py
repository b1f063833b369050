"""The block allocator: exact ids, all-or-nothing verbs, pages, holders under any sequence of operations."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radianced.kv.blocks import BlockAllocator, OutOfBlocks
from radianced.kv.pages import FixedPages


def test_fixed_pool_hands_out_lowest_ids_and_counts_exactly():
    alloc = BlockAllocator.fixed(num_blocks=8, block_size=4)
    t = alloc.new_table()
    alloc.append(t, 10)  # 3 blocks
    assert t.ids() == (0, 1, 2)
    assert t.frozen() == ((0, 1, 2),)
    assert (alloc.num_used, alloc.num_allocatable(), alloc.kv_util) == (3, 5, 3 / 8)
    alloc.append(t, 12)  # still 3 blocks
    assert t.ids() == (0, 1, 2)
    alloc.append(t, 13)
    assert t.ids() == (0, 1, 2, 3)
    alloc.free(t)
    assert len(t) == 0
    assert (alloc.num_used, alloc.num_allocatable(), alloc.kv_util) == (0, 8, 0.0)


def test_out_of_blocks_changes_nothing():
    alloc = BlockAllocator.fixed(num_blocks=4, block_size=4)
    t = alloc.new_table()
    alloc.append(t, 12)
    assert not alloc.can_append(t, 17)
    with pytest.raises(OutOfBlocks):
        alloc.append(t, 17)  # needs 2 more, 1 left
    assert t.ids() == (0, 1, 2)
    assert alloc.num_allocatable() == 1
    assert alloc.pages.available() == 1


def test_groups_move_in_lockstep_and_lease_pages_by_group():
    # group a: 2 blocks per page, group b: 1 block per page, one page source of 6 pages
    pages = FixedPages(6)
    alloc = BlockAllocator(4, pages, {"a": 2, "b": 1})
    t = alloc.new_table()
    alloc.append(t, 12)  # 3 logical blocks: a leases pages 0, 1; b leases pages 2, 3, 4
    assert t.frozen() == ((0, 1, 2), (2, 3, 4))
    assert list(t) == [(0, 2), (1, 3), (2, 4)]
    assert [sorted(p.pages) for p in alloc.pools] == [[0, 1], [2, 3, 4]]
    assert pages.available() == 1
    # a has one free block (3, on page 1); b has none; one page left: a fourth block fits, a fifth does not
    assert alloc.num_allocatable() == 1
    assert alloc.can_allocate(1) and not alloc.can_allocate(2)
    alloc.free(t)
    assert alloc.release_pages() == 5
    assert pages.available() == 6
    assert [p.num_leased for p in alloc.pools] == [0, 0]


def test_pages_return_only_when_every_block_is_free():
    pages = FixedPages(3)
    alloc = BlockAllocator(4, pages, {"kv_attn": 2})
    t1, t2 = alloc.new_table(), alloc.new_table()
    alloc.append(t1, 4)  # block 0 (page 0)
    alloc.append(t2, 8)  # blocks 1 (page 0), 2 (page 1)
    alloc.free(t1)
    assert alloc.release_pages() == 0  # page 0 still has block 1; page 1 has block 2 held, block 3 free
    alloc.free(t2)
    assert alloc.release_pages() == 2
    assert pages.available() == 3


def test_surrender_takes_empty_pages_out_without_giving_them_back():
    pages = FixedPages(4)
    alloc = BlockAllocator(4, pages, {"kv_attn": 2})
    t1, t2 = alloc.new_table(), alloc.new_table()
    alloc.append(t1, 16)  # blocks 0-3: pages 0, 1
    alloc.append(t2, 4)  # block 4: page 2 (block 5 free)
    alloc.free(t1)
    assert alloc.surrender_pages(5) == [0, 1]  # page 2 holds a live block
    assert pages.available() == 1  # the arena releases surrendered pages itself
    assert alloc.pools[0].pages == {2}
    assert alloc.num_allocatable() == 1 + 2  # block 5, and page 3 from the source


_EVICT_UNDER_O = textwrap.dedent("""
    import json, sys
    from radianced.kv.blocks import BlockAllocator
    from radianced.kv.prefix import PrefixCache, extend_block_hashes

    alloc = BlockAllocator.fixed(num_blocks=2, block_size=4)
    cache = PrefixCache(alloc)
    table = alloc.new_table()
    alloc.append(table, 8)  # blocks 0 1, both full
    cache.insert(table, extend_block_hashes([], list(range(8)), 4), 0, 2)
    alloc.free(table)  # both blocks idle in the cache: evictable
    blocks = alloc.allocate(1)  # no free block, no page left: the least recently released one is evicted
    print(json.dumps({"optimize": sys.flags.optimize, "blocks": blocks, "cached": cache.num_cached,
                      "evictable": cache.evictable()}))
""")


def test_eviction_runs_under_python_O():
    """`allocate` evicted inside an `assert`: under `python -O` the eviction was skipped and the
    page source, asked for a page it did not have, raised OutOfBlocks after can_allocate said yes."""
    done = subprocess.run([sys.executable, "-O", "-c", _EVICT_UNDER_O], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    # the tail (block 1) was released first, so it is evicted first
    assert json.loads(done.stdout) == {"optimize": 1, "blocks": [[1]], "cached": 1, "evictable": 1}


def test_double_free_is_refused():
    alloc = BlockAllocator.fixed(num_blocks=2, block_size=4)
    [b] = alloc.allocate(1)
    alloc.drop([b])
    with pytest.raises(ValueError, match="freed twice"):
        alloc.drop([b])


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/append/share/free/release over two groups sharing a page source.
    The shadow: every live table; holders of a block = tables that list it."""

    @initialize(num_pages=st.integers(1, 12), per_page=st.tuples(st.integers(1, 3), st.integers(1, 3)))
    def setup(self, num_pages, per_page):
        self.num_pages = num_pages
        self.pages = FixedPages(num_pages)
        self.alloc = BlockAllocator(4, self.pages, {"a": per_page[0], "b": per_page[1]})
        self.tables = []  # [table, tokens]

    @rule(tokens=st.integers(0, 24))
    def new_table(self, tokens):
        t = self.alloc.new_table()
        fits = self.alloc.can_append(t, tokens)
        before = self.alloc.num_allocatable()
        try:
            self.alloc.append(t, tokens)
        except OutOfBlocks:
            assert not fits and self.alloc.num_allocatable() == before
            return
        assert fits
        self.tables.append([t, tokens])

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), more=st.integers(1, 12))
    def append(self, data, more):
        entry = data.draw(st.sampled_from(self.tables))
        fits = self.alloc.can_append(entry[0], entry[1] + more)
        try:
            self.alloc.append(entry[0], entry[1] + more)
            entry[1] += more
        except OutOfBlocks:
            assert not fits
        else:
            assert fits

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def share(self, data):
        """A new table over the full blocks of a live one (as a prefix hit shares them)."""
        t, tokens = data.draw(st.sampled_from(self.tables))
        full = tokens // 4
        child = self.alloc.new_table()
        self.alloc.share(child, [t[i] for i in range(full)])
        self.tables.append([child, full * 4])

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data):
        entry = data.draw(st.sampled_from(self.tables))
        self.tables.remove(entry)
        self.alloc.free(entry[0])

    @rule()
    def release_pages(self):
        self.alloc.release_pages()

    @rule(n=st.integers(0, 3))
    def surrender_pages(self, n):
        taken = self.alloc.surrender_pages(n)
        assert len(taken) <= n
        self.pages.give_back(taken)  # as the arena does when it releases them

    @invariant()
    def holders_are_exact(self):
        holders: dict[tuple, int] = {}
        for t, tokens in self.tables:
            assert len(t) == -(-tokens // 4)
            for block in t:
                holders[block] = holders.get(block, 0) + 1
        leased_pages = set()
        for g, pool in enumerate(self.alloc.pools):
            free = pool.free_blocks()
            assert len(free) == len(set(free)), "a block is on the free list twice"
            held = {}
            for block, n in holders.items():
                held[block[g]] = held.get(block[g], 0) + n
            assert not set(free) & set(held), "a held block is on the free list"
            for b, n in held.items():
                assert pool.ref_count(b) == n
            for b in free:
                assert pool.ref_count(b) == 0
            assert pool.num_free + len(held) == pool.num_leased == len(pool.pages) * pool.blocks_per_page
            assert not leased_pages & pool.pages, "a page leased to two groups"
            leased_pages |= pool.pages
        assert len(leased_pages) + self.pages.available() == self.num_pages
        used = len(holders)
        assert self.alloc.num_used == used
        total = used + self.alloc.num_allocatable()
        assert self.alloc.kv_util == (used / total if total else 0.0)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
