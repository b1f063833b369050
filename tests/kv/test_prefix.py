"""The prefix cache: hash chain, matches, LRU eviction, checkpoints, and holders under any sequence of operations."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radianced.kv.blocks import BlockAllocator
from radianced.kv.pages import FixedPages
from radianced.kv.prefix import PrefixCache, PrefixMatch, extend_block_hashes, hash_block
from radianced.kv.state import CheckpointSlots

BS = 4


def cached_table(alloc: BlockAllocator, cache: PrefixCache, tokens: list[int]):
    """A table whose tokens are all computed, its full blocks offered to the cache."""
    table = alloc.new_table()
    alloc.append(table, len(tokens))
    hashes = extend_block_hashes([], tokens, BS)
    cache.insert(table, hashes, 0, len(hashes))
    return table, hashes


def test_a_key_names_the_whole_prefix():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4]) and len(a) == 16
    assert hash_block(a, [1, 2, 3, 4]) != a  # same tokens, one block deeper
    assert hash_block(None, [1, 2, 3, 5]) != a
    hashes = extend_block_hashes([], list(range(10)), BS)  # 2 full blocks, the partial one is not keyed
    assert hashes == [hash_block(None, [0, 1, 2, 3]), hash_block(hash_block(None, [0, 1, 2, 3]), [4, 5, 6, 7])]
    assert extend_block_hashes(hashes[:1], list(range(10)), BS) == hashes


def test_match_reuses_full_blocks_and_never_the_last_token():
    alloc = BlockAllocator.fixed(16, BS)
    cache = PrefixCache(alloc)
    prompt = list(range(10))
    table, _ = cached_table(alloc, cache, prompt)  # blocks 0 1 cached, block 2 (2 tokens) not
    alloc.free(table)
    assert cache.match(prompt + [10, 11]) == PrefixMatch(blocks=((0,), (1,)), num_tokens=8, num_evictable=2)
    assert cache.match(prompt[:8]) == PrefixMatch(blocks=((0,),), num_tokens=4, num_evictable=1)
    assert cache.match(prompt[:4]) == PrefixMatch()
    assert cache.match([9] + prompt) == PrefixMatch()
    assert cache.match([]) == PrefixMatch()


def test_acquire_makes_the_table_a_holder():
    alloc = BlockAllocator.fixed(16, BS)
    cache = PrefixCache(alloc)
    prompt = list(range(12))
    table, _ = cached_table(alloc, cache, prompt)
    alloc.free(table)
    assert (cache.evictable(), alloc.num_used) == (3, 0)
    m = cache.match(prompt + [1])
    second = alloc.new_table()
    cache.acquire(m, second)
    assert second.ids() == (0, 1, 2)
    assert [alloc.ref_count((b,)) for b in range(3)] == [2, 2, 2]
    assert (cache.evictable(), alloc.num_used) == (0, 3)
    alloc.free(second)
    assert (cache.evictable(), alloc.num_used) == (3, 0)


def test_eviction_takes_least_recently_released_tails_first():
    alloc = BlockAllocator.fixed(16, BS)
    cache = PrefixCache(alloc)
    a, _ = cached_table(alloc, cache, [1] * 12)  # blocks 0 1 2
    b, _ = cached_table(alloc, cache, [2] * 8)  # blocks 3 4
    alloc.free(a)
    alloc.free(b)
    assert cache.evict(2) == 2
    assert [blk for blk, _ in cache.cached_blocks()] == [(0,), (3,), (4,)]  # a's tail went first
    assert cache.match([1] * 12) == PrefixMatch(blocks=((0,),), num_tokens=4, num_evictable=1)
    assert cache.evict(10) == 3
    assert (cache.num_cached, alloc.num_allocatable(), alloc.pools[0].num_held) == (0, 16, 0)


def test_allocation_takes_free_blocks_then_pages_then_evicts_only_the_shortfall():
    alloc = BlockAllocator.fixed(4, BS)
    cache = PrefixCache(alloc)
    t, _ = cached_table(alloc, cache, list(range(12)))  # blocks 0 1 2 on 3 of the 4 pages
    alloc.free(t)
    assert (alloc.pools[0].num_free, alloc.pages.available(), cache.evictable()) == (0, 1, 3)
    assert alloc.can_allocate(4) and not alloc.can_allocate(5)
    assert not alloc.can_allocate(4, exclude=1)  # one of the cached blocks is about to be reused
    assert alloc.allocate(2) == [(2,), (3,)]  # page 3, and block 2 evicted (the tail)
    assert [blk for blk, _ in cache.cached_blocks()] == [(0,), (1,)]
    assert alloc.num_used == 2 and cache.evictable() == 2


def test_a_twin_block_stays_private_and_is_freed_with_its_table():
    alloc = BlockAllocator.fixed(16, BS)
    cache = PrefixCache(alloc)
    first, _ = cached_table(alloc, cache, [7] * 8)  # blocks 0 1
    twin, _ = cached_table(alloc, cache, [7] * 8)  # computed again into blocks 2 3: not cached
    assert [blk for blk, _ in cache.cached_blocks()] == [(0,), (1,)]
    assert [alloc.ref_count((b,)) for b in range(4)] == [2, 2, 1, 1]
    alloc.free(twin)
    assert alloc.pools[0].free_blocks() == (3, 2)
    alloc.free(first)
    assert cache.evictable() == 2


def test_hybrid_match_ends_at_the_deepest_checkpoint():
    alloc = BlockAllocator.fixed(16, BS)
    ckpts = CheckpointSlots(2)
    cache = PrefixCache(alloc, hybrid=True, checkpoints=ckpts)
    tokens = list(range(16))
    table, hashes = cached_table(alloc, cache, tokens)  # 4 cached blocks, no checkpoint yet
    assert cache.match(tokens + [99]) == PrefixMatch()
    assert cache.take_checkpoint() == 0
    assert cache.attach_checkpoint(hashes[1], 0)  # the state after 8 tokens
    assert cache.match(tokens + [99]) == PrefixMatch(((0,), (1,)), 8, checkpoint=0)
    assert cache.take_checkpoint() == 1
    assert cache.attach_checkpoint(hashes[3], 1)
    assert not cache.attach_checkpoint(hashes[3], 1)  # one checkpoint per block
    assert cache.match(tokens + [99]) == PrefixMatch(((0,), (1,), (2,), (3,)), 16, checkpoint=1)
    assert cache.match(tokens) == PrefixMatch(((0,), (1,)), 8, checkpoint=0)  # the last token is computed
    assert cache.take_checkpoint() is None  # both kept with blocks a table holds
    alloc.free(table)
    assert cache.take_checkpoint() == 1  # detached from the least recently released idle block (the tail)
    assert cache.match(tokens + [99]) == PrefixMatch(((0,), (1,)), 8, checkpoint=0, num_evictable=2)
    assert cache.evict(3) == 3  # blocks 3 2 1: checkpoint 0 leaves with block 1
    assert (ckpts.num_free, ckpts.num_taken) == (1, 1)
    assert cache.match(tokens + [99]) == PrefixMatch()


class PrefixMachine(RuleBasedStateMachine):
    """Random start (match + acquire + compute) / extend / free / evict / checkpoint /
    release-pages over two paging groups. The shadow records what each physical block
    holds (written token by token) and which prefix each checkpoint holds, so every
    match is checked against the tokens it claims to skip."""

    @initialize(num_pages=st.integers(2, 16), per_page=st.tuples(st.integers(1, 3), st.integers(1, 2)),
                hybrid=st.booleans())
    def setup(self, num_pages, per_page, hybrid):
        self.num_pages = num_pages
        self.pages = FixedPages(num_pages)
        self.alloc = BlockAllocator(BS, self.pages, {"a": per_page[0], "b": per_page[1]})
        self.ckpts = CheckpointSlots(3)
        self.cache = PrefixCache(self.alloc, hybrid, self.ckpts if hybrid else None)
        self.hybrid = hybrid
        self.seqs: list[dict] = []
        self.seen: list[list[int]] = []
        self.kv: dict[tuple[int, int], dict[int, int]] = {}  # (group, block) -> offset -> token
        self.state: dict[int, tuple[int, ...]] = {}  # checkpoint slot -> the prefix it holds

    def _compute(self, seq, start):
        """Write tokens start.. into the table's blocks and offer full blocks to the cache."""
        table, tokens = seq["table"], seq["tokens"]
        for p in range(start, len(tokens)):
            for g, b in enumerate(table[p // BS]):
                self.kv.setdefault((g, b), {})[p % BS] = tokens[p]
        extend_block_hashes(seq["hashes"], tokens, BS)
        self.cache.insert(table, seq["hashes"], 0, len(tokens) // BS)

    def _check_match(self, tokens, m: PrefixMatch):
        assert m.num_tokens == len(m.blocks) * BS < len(tokens)
        for i, block in enumerate(m.blocks):
            for g, b in enumerate(block):
                assert [self.kv[(g, b)][o] for o in range(BS)] == tokens[i * BS:(i + 1) * BS]
        if self.hybrid and m.blocks:
            assert self.state[m.checkpoint] == tuple(tokens[:m.num_tokens])
        else:
            assert m.checkpoint is None

    @rule(data=st.data(), fresh=st.lists(st.integers(0, 2), min_size=1, max_size=20))
    def start(self, data, fresh):
        tokens = fresh
        if self.seen and data.draw(st.booleans()):  # mostly a turn after an earlier one: prefixes repeat
            old = data.draw(st.sampled_from(self.seen))
            tokens = old[:data.draw(st.integers(0, len(old)))] + fresh
        self.seen.append(tokens)
        m = self.cache.match(tokens)
        self._check_match(tokens, m)
        need = self.alloc.blocks_for(len(tokens)) - len(m.blocks)
        if not self.alloc.can_allocate(need, exclude=m.num_evictable):
            assert self.alloc.num_allocatable(exclude=m.num_evictable) < need
            return
        seq = {"table": self.alloc.new_table(), "tokens": tokens, "hashes": []}
        self.cache.acquire(m, seq["table"])
        self.alloc.append(seq["table"], len(tokens))
        self._compute(seq, m.num_tokens)
        self.seqs.append(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), min_size=1, max_size=8))
    def extend(self, data, more):
        seq = data.draw(st.sampled_from(self.seqs))
        n = len(seq["tokens"])
        if self.alloc.can_append(seq["table"], n + len(more)):
            self.alloc.append(seq["table"], n + len(more))
            seq["tokens"] = seq["tokens"] + more
            self._compute(seq, n)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.seqs))
        self.seqs.remove(seq)
        self.alloc.free(seq["table"])

    @rule(n=st.integers(0, 6))
    def evict(self, n):
        before = self.cache.evictable()
        assert self.cache.evict(n) == min(n, before)
        assert self.cache.evictable() == before - min(n, before)

    @precondition(lambda self: self.hybrid and any(len(s["tokens"]) >= BS for s in self.seqs))
    @rule(data=st.data())
    def checkpoint(self, data):
        seq = data.draw(st.sampled_from([s for s in self.seqs if len(s["tokens"]) >= BS]))
        k = data.draw(st.integers(1, len(seq["tokens"]) // BS))
        slot = self.cache.take_checkpoint()
        if slot is None:
            return
        self.state[slot] = tuple(seq["tokens"][:k * BS])
        if not self.cache.attach_checkpoint(seq["hashes"][k - 1], slot):
            self.ckpts.free(slot)

    @rule()
    def release_pages(self):
        self.alloc.release_pages()

    @rule(n=st.integers(0, 3))
    def surrender_pages(self, n):
        taken = self.alloc.surrender_pages(n)
        assert len(taken) <= n
        for seq in self.seqs:  # every live block's page stays with its group
            for block in seq["table"]:
                for b, pool in zip(block, self.alloc.pools):
                    assert b // pool.blocks_per_page in pool.pages
        self.pages.give_back(taken)

    @invariant()
    def holders_are_exact(self):
        holders: dict[tuple, int] = {}
        for seq in self.seqs:
            assert len(seq["table"]) == self.alloc.blocks_for(len(seq["tokens"]))
            for block in seq["table"]:
                holders[block] = holders.get(block, 0) + 1
        cached = self.cache.cached_blocks()
        assert len({b for b, _ in cached}) == len(cached)
        idle = 0
        for block, _ in cached:
            idle += block not in holders
            holders[block] = holders.get(block, 0) + 1
        assert self.cache.evictable() == idle
        assert self.alloc.num_used == len(holders) - idle
        leased = set()
        for g, pool in enumerate(self.alloc.pools):
            held = {block[g]: n for block, n in holders.items()}
            assert len(held) == len(holders), "two logical blocks share a physical block"
            free = pool.free_blocks()
            assert len(set(free)) == len(free) and not set(free) & set(held)
            assert all(pool.ref_count(b) == n for b, n in held.items())
            assert pool.num_free + len(held) == pool.num_leased == len(pool.pages) * pool.blocks_per_page
            assert not leased & pool.pages
            leased |= pool.pages
        assert len(leased) + self.pages.available() == self.num_pages
        slots = [c for _, c in cached if c is not None]
        assert len(set(slots)) == len(slots)
        if self.hybrid:
            assert len(slots) + self.ckpts.num_free == self.ckpts.capacity
        else:
            assert not slots


TestPrefixMachine = PrefixMachine.TestCase
TestPrefixMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
