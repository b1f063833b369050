"""Where KV block pools get their pages (kv/blocks.py): the `PageSource` protocol, the fixed set of pages
used where there is no arena (`FixedPages`), and what evicting a cached block costs against the pages an
arena would take back from another tenant (`RECOMPUTE_COST`, `PageSource.cheaper_than_recycling`).

Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

RECOMPUTE_COST = 1.0  # per byte, of an evicted cached block (its prefill again); an expert slot's is >= 1.0


class OutOfBlocks(RuntimeError):  # kv/blocks.py's error; here because a fixed page source raises it too
    """The pool cannot hand out that many blocks; nothing was allocated."""


class PageSource(Protocol):
    """Where block pools get their pages: the arena's KV tenant.

    Shared by every group of one allocator; a page is leased to one group at a time.
    """

    def available(self) -> int:
        """Pages `lease` would hand out now."""
        ...

    def lease(self, n: int) -> list[int]:
        """Exactly n page ids (n <= available())."""
        ...

    def give_back(self, pages: Iterable[int]) -> None:
        """Take back pages that hold no live or cached block."""
        ...

    def cheaper_than_recycling(self, own_cost: float) -> int:
        """Pages `lease` would hand out at less cost than `own_cost`, the cost per byte of evicting the
        pools' own cached blocks (the arena's one eviction order): the free ones, and all of
        `available()` when another tenant's cheapest page costs less (a tie recycles)."""
        ...


class FixedPages:
    """A fixed set of pages 0..num_pages-1, leased lowest id first."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() gives 0, 1, 2, ...

    def available(self) -> int:
        return len(self._free)

    def lease(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} pages, {len(self._free)} of {self.num_pages} left")
        return [self._free.pop() for _ in range(n)]

    def give_back(self, pages: Iterable[int]) -> None:
        self._free.extend(pages)
        self._free.sort(reverse=True)

    def cheaper_than_recycling(self, own_cost: float) -> int:
        return len(self._free)  # all free: no other tenant
