"""The KV tenant as the arena sees it: what it can give up, at what cost, and the giving.

In lending mode (DESIGN.md "One arena, two tenants") the arena asks each tenant
how many pages it could hand over and what that costs, and takes pages from the
cheapest. The KV tenant gives up pages no live request uses: empty ones first,
then the pages of idle prefix-cached blocks, least recently used first (the
allocator's eviction order).
"""

from __future__ import annotations

import math

from radianced.arena import KV, Lease
from radianced.kv.blocks import BlockAllocator
from radianced.kv.pages import RECOMPUTE_COST


class KVReclaimer:
    """The arena's reclaimer for the KV tenant of one block allocator."""

    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator

    def surrenderable(self) -> int:
        """Pages the KV tenant could give up now: the empty ones, and as many whole pages as its
        evictable (idle prefix-cached) blocks fill."""
        pools = self.allocator.pools
        return sum(len(p.empty_pages()) for p in pools) + self.allocator.evictable() // max(
            p.blocks_per_page for p in pools)

    def reclaim_cost(self) -> float:
        """For another tenant's lease: a recompute of cached prefixes (RECOMPUTE_COST), math.inf when no
        whole page can be given up. (KV's own allocations weigh their cached blocks the same way.)"""
        return RECOMPUTE_COST if self.surrenderable() else math.inf

    def surrender(self, n: int) -> Lease:
        """Give up n pages (at most `surrenderable()`), evicting cached blocks as needed."""
        return Lease(KV, tuple(self.allocator.surrender_pages(n)))
