"""The card the budget divides: its size (`Card`), the units it is counted and
allocated in, and `detect_card`, which reads this machine's card.

`Card` is plain numbers (the budget stays free of torch); only `detect_card`
asks torch, and imports it when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

PAGE_ALIGN = 4096  # expert slots and pages are whole 4 KiB pieces (O_DIRECT, any dtype view)
# The CUDA caching allocator hands out a large block in whole 2 MiB units and keeps a tail of 1 MiB or
# less inside the block (counted as allocated): on CUDA the arena asks for whole units (`Card.alloc_granule`).
ALLOC_GRANULE = 2 * MiB


def align_up(n: int, a: int = PAGE_ALIGN) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class Card:
    """The device memory the split divides. On CUDA from `mem_get_info`; on the CPU
    backend half of RAM (see `detect_card`); `--card-mib` plans an empty card."""

    total_bytes: int
    free_bytes: int
    cuda: bool = False  # a GPU: the caching allocator's 2 MiB units, decode graphs on their own stream

    def __post_init__(self):
        if not 0 <= self.free_bytes <= self.total_bytes:
            raise ValueError(f"card free bytes {self.free_bytes} must be between 0 and total {self.total_bytes}")

    @property
    def alloc_granule(self) -> int:
        """The allocator's unit for the arena: ALLOC_GRANULE on CUDA, a page of RAM otherwise."""
        return ALLOC_GRANULE if self.cuda else PAGE_ALIGN

    @classmethod
    def from_mib(cls, total_mib: int, free_mib: int | None = None, cuda: bool = False) -> Card:
        return cls(total_mib * MiB, (total_mib if free_mib is None else free_mib) * MiB, cuda)


def detect_card(device: torch.device | str) -> Card:
    """The card `plan` divides: CUDA's free and total memory, or on the CPU half of RAM
    (free: the part of that half the OS reports available)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return Card(total, free, cuda=True)
    import psutil

    vm = psutil.virtual_memory()
    total = vm.total // 2
    return Card(total, min(total, vm.available))
