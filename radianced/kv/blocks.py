"""KV blocks of the paged cache: ref-counted blocks per paging group, leased page by page.

- A *paging group* is a set of layers with one KV layout; they share a token
  axis and a block table ("kv_attn" = the full-attention layers, and the MTP
  layers when they draft: the one group today). Each group has its own `BlockPool`.
- A *block* holds `block_size` consecutive tokens of one group.
- A *page* is the arena's unit. Page p of a group holds that group's blocks
  p*N .. p*N+N-1 (N = the group's blocks per page), which is how `KVCache`
  storage [P, N, ...] is indexed. Pools lease pages from a `PageSource` (kv/pages.py:
  the arena's KV tenant, `arena.TenantPages`; `FixedPages`, a fixed set, where there
  is no arena: tests and the oracle's greedy driver), give back pages whose blocks
  are all free (`release_pages`), and surrender pages to the arena when it takes
  them back for expert slots (`surrender_pages`: empty pages, then evicting idle
  cached blocks).
- Groups move in lockstep: logical block i of a sequence is one physical block
  in every group, a `KVBlock` = (id in group 0, id in group 1, ...). A
  `BlockTable` lists a sequence's logical blocks.

Holders: each table listing a block holds one reference, and so does the
prefix cache for every block it keeps. A block nobody holds is free. The prefix
cache registers itself as the allocator's `reclaimer`: blocks only it holds are
*evictable*, counted as available by `can_allocate`, and evicted (LRU) by
`allocate` when free blocks and free pages run out, before pages are taken back
from another tenant unless that tenant's are cheaper to get back.

Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Protocol

from radianced.kv.pages import RECOMPUTE_COST, FixedPages, OutOfBlocks, PageSource

KVBlock = tuple[int, ...]  # one physical block id per paging group


class Reclaimer(Protocol):
    """What the allocator needs from the prefix cache."""

    def evictable(self) -> int:
        """Blocks only the cache holds."""
        ...

    def evict(self, n: int) -> int:
        """Drop the cache's hold on n evictable blocks (LRU first); returns how many."""
        ...

    def released(self, blocks: Sequence[KVBlock]) -> None:
        """A table let go of `blocks` (in this order: its tail first)."""
        ...


class BlockTable:
    """One sequence's logical blocks; `ids(g)` is the table of paging group g."""

    __slots__ = ("_ids",)

    def __init__(self, num_groups: int = 1):
        self._ids: tuple[list[int], ...] = tuple([] for _ in range(num_groups))

    def __len__(self) -> int:
        return len(self._ids[0])

    def __getitem__(self, i: int) -> KVBlock:
        return tuple(ids[i] for ids in self._ids)

    def __iter__(self) -> Iterator[KVBlock]:
        return zip(*self._ids)

    def ids(self, group: int = 0) -> tuple[int, ...]:
        return tuple(self._ids[group])

    def frozen(self) -> tuple[tuple[int, ...], ...]:
        """Every group's table, for a `StepPlan`."""
        return tuple(tuple(ids) for ids in self._ids)

    def _extend(self, blocks: Iterable[KVBlock]) -> None:
        for block in blocks:
            for ids, b in zip(self._ids, block):
                ids.append(b)

    def _clear(self) -> None:
        for ids in self._ids:
            ids.clear()


class BlockPool:
    """One paging group's blocks: holder counts, the free list and the leased pages."""

    def __init__(self, name: str, blocks_per_page: int, pages: PageSource):
        if blocks_per_page < 1:
            raise ValueError(f"group {name}: blocks_per_page {blocks_per_page} < 1")
        self.name = name
        self.blocks_per_page = blocks_per_page
        self._source = pages
        self._refs: dict[int, int] = {}  # every block of a leased page -> holders (0 = free)
        self._free: list[int] = []  # a stack: freed blocks on top, fresh pages at the bottom
        self._pages: set[int] = set()

    @property
    def num_leased(self) -> int:
        return len(self._refs)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        return len(self._refs) - len(self._free)

    @property
    def pages(self) -> frozenset[int]:
        return frozenset(self._pages)

    def free_blocks(self) -> tuple[int, ...]:
        return tuple(self._free)

    def ref_count(self, block: int) -> int:
        if block not in self._refs:
            raise ValueError(f"{self.name}: block {block} is not on a leased page")
        return self._refs[block]

    def pages_needed(self, n: int, extra_free: int = 0) -> int:
        """Pages to lease before `n` blocks can be taken, with `extra_free` more blocks freed first."""
        short = n - len(self._free) - extra_free
        return -(-short // self.blocks_per_page) if short > 0 else 0

    def grow(self, num_pages: int) -> None:
        n = self.blocks_per_page
        fresh = []
        for page in self._source.lease(num_pages):
            self._pages.add(page)
            fresh.extend(range(page * n, page * n + n))
        for b in fresh:
            self._refs[b] = 0
        # under the blocks already free: fill pages in use before new ones, so pages drain and return
        self._free[:0] = reversed(fresh)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"{self.name}: asked for {n} blocks, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def hold(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self.ref_count(b) < 1:
                raise ValueError(f"{self.name}: block {b} is free; only a held block gains holders")
            self._refs[b] += 1

    def drop(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self.ref_count(b) < 1:
                raise ValueError(f"{self.name}: block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def empty_pages(self) -> list[int]:
        """Leased pages whose blocks are all free, lowest first."""
        n = self.blocks_per_page
        free_per_page: dict[int, int] = {}
        for b in self._free:
            free_per_page[b // n] = free_per_page.get(b // n, 0) + 1
        return sorted(p for p, k in free_per_page.items() if k == n)

    def shrink(self, limit: int | None = None, give_back: bool = True) -> list[int]:
        """Drop up to `limit` (default all) empty pages from the pool, giving them back to
        the page source unless `give_back` is False (the caller returns them); returns them."""
        empty = self.empty_pages()[:limit]
        if empty:
            n = self.blocks_per_page
            gone = set(empty)
            self._free = [b for b in self._free if b // n not in gone]
            for p in empty:
                for b in range(p * n, p * n + n):
                    del self._refs[b]
            self._pages -= gone
            if give_back:
                self._source.give_back(empty)
        return empty


class BlockAllocator:
    """Logical KV blocks over one `BlockPool` per paging group, all fed by one `PageSource`.

    Paired verbs: `can_allocate`/`allocate`, `can_append`/`append` and its undo `truncate`, `free`.
    Each either does all of its work or raises `OutOfBlocks` having changed nothing.
    Allocation takes free blocks first, then free pages (and pages of another
    tenant cheaper to get back than a recompute: `cheaper_than_recycling`, the
    arena's one eviction order), then evicts cached blocks (through `reclaimer`;
    none that saves no page), and leases the rest.
    """

    def __init__(self, block_size: int, pages: PageSource, groups: Mapping[str, int] | None = None):
        """`groups`: paging group name -> blocks per page (default: one group, "kv_attn", 1)."""
        if block_size < 1:
            raise ValueError(f"block_size {block_size} < 1")
        groups = {"kv_attn": 1} if groups is None else groups
        if not groups:
            raise ValueError("at least one paging group")
        self.block_size = block_size
        self.pages = pages
        self.pools = tuple(BlockPool(name, n, pages) for name, n in groups.items())
        self.reclaimer: Reclaimer | None = None  # set by PrefixCache(allocator)

    @classmethod
    def fixed(cls, num_blocks: int, block_size: int) -> BlockAllocator:
        """One group of `num_blocks` blocks, one block per page, with no arena behind it."""
        return cls(block_size, FixedPages(num_blocks))

    @property
    def num_groups(self) -> int:
        return len(self.pools)

    def new_table(self) -> BlockTable:
        return BlockTable(len(self.pools))

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # -- accounting -----------------------------------------------------------

    def evictable(self) -> int:
        return self.reclaimer.evictable() if self.reclaimer is not None else 0

    @property
    def num_used(self) -> int:
        """Logical blocks some table holds (cached blocks only the cache holds are not used)."""
        return self.pools[0].num_held - self.evictable()

    def ref_count(self, block: KVBlock) -> int:
        return self.pools[0].ref_count(block[0])

    def _pages_needed(self, n: int, evicted: int) -> int:
        return sum(pool.pages_needed(n, evicted) for pool in self.pools)

    def can_allocate(self, n: int, exclude: int = 0) -> bool:
        """Could `allocate(n)` succeed, not counting `exclude` evictable blocks (a prefix
        match about to be acquired)?"""
        return self._pages_needed(n, self.evictable() - exclude) <= self.pages.available()

    def num_allocatable(self, exclude: int = 0) -> int:
        """The most blocks `allocate` could hand out now."""
        lo = 0
        hi = max(p.num_free + self.evictable() + self.pages.available() * p.blocks_per_page for p in self.pools)
        while lo < hi:  # largest n with can_allocate(n)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.can_allocate(mid, exclude) else (lo, mid - 1)
        return lo

    @property
    def kv_util(self) -> float:
        """Used blocks / pool blocks (used + what could still be handed out)."""
        used = self.num_used
        pool = used + self.num_allocatable()
        return used / pool if pool else 0.0

    # -- the verbs ------------------------------------------------------------

    def allocate(self, n: int) -> list[KVBlock]:
        """n fresh blocks, one holder each. Raises OutOfBlocks (nothing changed) if impossible."""
        if n <= 0:
            return []
        if not self.can_allocate(n):
            raise OutOfBlocks(f"asked for {n} KV blocks; {self.num_allocatable()} can be handed out "
                              f"({self.num_used} in use)")
        # evict cached blocks until the pages cheaper than that cover the rest (a lease never recycles the
        # pool's own pages: it cannot count the free blocks they hold), but none that saves no page;
        # can_allocate counted the rest
        evict, evictable = 0, self.evictable()
        if evictable and self._pages_needed(n, 0):
            cheaper = self.pages.cheaper_than_recycling(RECOMPUTE_COST)
            while evict < evictable and self._pages_needed(n, evict) > cheaper:
                evict += 1
            while evict and self._pages_needed(n, evict - 1) == self._pages_needed(n, evict):
                evict -= 1
        if evict:  # can_allocate counted these as evictable, so a reclaimer is set
            evicted = self.reclaimer.evict(evict)
            if evicted != evict:  # a broken reclaimer; not an assert: python -O would skip the eviction
                raise RuntimeError(f"the reclaimer evicted {evicted} of the {evict} blocks it counted as evictable")
        for pool in self.pools:
            pool.grow(pool.pages_needed(n))
        return list(zip(*(pool.take(n) for pool in self.pools)))

    def can_append(self, table: BlockTable, tokens: int) -> bool:
        """Could `append(table, tokens)` succeed? (Most decode steps need no new block: True at once.)"""
        n = self.blocks_for(tokens) - len(table)
        return n <= 0 or self.can_allocate(n)

    def append(self, table: BlockTable, tokens: int) -> None:
        """Grow `table` until it holds `tokens` tokens (all or nothing)."""
        table._extend(self.allocate(self.blocks_for(tokens) - len(table)))

    def truncate(self, table: BlockTable, tokens: int) -> None:
        """Shrink `table` to the blocks that hold `tokens` tokens, dropping its hold on the rest (tail
        first): a verify step's blocks that only rejected drafts reached. Never fails."""
        keep = self.blocks_for(tokens)
        if keep >= len(table):
            return
        blocks = [table[i] for i in range(len(table) - 1, keep - 1, -1)]
        for ids in table._ids:
            del ids[keep:]
        self.drop(blocks)
        if self.reclaimer is not None:
            self.reclaimer.released(blocks)

    def free(self, table: BlockTable) -> None:
        """Drop the table's hold on all its blocks (tail first, so the prefix cache evicts
        tails before heads) and empty it."""
        blocks = [table[i] for i in range(len(table) - 1, -1, -1)]
        table._clear()
        self.drop(blocks)
        if self.reclaimer is not None:
            self.reclaimer.released(blocks)

    def share(self, table: BlockTable, blocks: Sequence[KVBlock]) -> None:
        """Append already-held blocks (a prefix hit) to `table`, which becomes one more holder."""
        self.hold(blocks)
        table._extend(blocks)

    def hold(self, blocks: Sequence[KVBlock]) -> None:
        """One more holder on each of `blocks` (all already held)."""
        for g, pool in enumerate(self.pools):
            pool.hold(b[g] for b in blocks)

    def drop(self, blocks: Sequence[KVBlock]) -> None:
        """One holder less on each; a block left with none is free."""
        for g, pool in enumerate(self.pools):
            pool.drop(b[g] for b in blocks)

    def release_pages(self) -> int:
        """Give back to the page source every page with no held block; returns how many."""
        return sum(len(pool.shrink()) for pool in self.pools)

    def surrender_pages(self, n: int) -> list[int]:
        """Up to n pages taken out of the pools for the arena to hand to another tenant
        (it releases them itself: this does not call `give_back`). Empty
        pages go first; then idle cached blocks are evicted, least recently released
        first, until enough pages empty or nothing is left to evict. Live blocks are
        never touched."""
        while sum(len(p.empty_pages()) for p in self.pools) < n and self.evictable():
            self.reclaimer.evict(1)
        out: list[int] = []
        for pool in self.pools:
            out += pool.shrink(n - len(out), give_back=False)
        return out
