"""KV block allocator: which block ids of the paged cache each sequence owns.

Minimal form (the engine issue adds ref counts, paging groups and the prefix
cache): a free list and exact accounting. Pure Python, no torch.
"""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than asked for; nothing was allocated."""


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        return [self._free.pop() for _ in range(n)]

    def grow(self, table: list[int], tokens: int) -> None:
        """Append blocks to `table` until it holds `tokens` tokens (all or nothing)."""
        need = self.blocks_for(tokens) - len(table)
        if need > 0:
            table.extend(self.allocate(need))

    def free(self, table: list[int]) -> None:
        self._free.extend(reversed(table))
        table.clear()
