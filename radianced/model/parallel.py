"""The communication of `--tp N` behind one small interface: a `Group` of N ranks, each holding
its card's share of the model (sharding.py says which), and the two collectives the forward
needs: a sum over the ranks (`all_reduce`, after every row-parallel projection, the routed
experts and the vocab-parallel embedding lookup) and a gather along the last dim (`all_gather`,
the lm_head's logits).

`SINGLE` is the one-process group of `--tp 1`: its collectives are the identity, and the blocks
ask `group.size == 1` to keep their fused epilogues (the residual added inside o_proj's launch),
so `--tp 1` runs exactly the code it ran before. `ProcessGroup` is torch.distributed's group:
gloo on the CPU (the tests run 2 real processes), NCCL on GPUs (one process per card,
`cuda:rank`; written, not yet run: no machine of several GPUs has been lent).
"""

from __future__ import annotations

import datetime
import os
from typing import Protocol

import torch

# Every process of `--tp` runs with NVLink multicast off (the device notes: NVLS on these hosts has
# hung NCCL's init); set before the first NCCL call of the process.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}


class Group(Protocol):
    """`size` ranks, this one `rank`; the forward's collectives over them."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (same shape everywhere), on every rank."""
        ...

    def all_gather(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """Every rank's share of a last dim of `total` (sharding.split_range's), joined in rank order."""
        ...


class Single:
    """The group of one process (`--tp 1`): rank 0 of 1, collectives are the identity."""

    rank, size = 0, 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, total: int) -> torch.Tensor:
        return x


SINGLE = Single()


class ProcessGroup:
    """This process's rank in torch.distributed's default group of `size` processes.

    all_reduce sums in place over the ranks and returns the tensor; all_gather concatenates the
    ranks' tensors along the last dim in rank order, every rank getting the whole.
    """

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    @classmethod
    def join(cls, rank: int, size: int, address: str, device: torch.device,
             timeout: datetime.timedelta | None = None) -> ProcessGroup:
        """Join the group of `size` processes at `address` ("host:port", rank 0 listens there): gloo
        for the CPU, NCCL (with `NCCL_ENV`) for `cuda:rank`. `timeout` bounds the join and each
        collective (torch's default if None)."""
        import torch.distributed as dist

        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl":
            os.environ.update(NCCL_ENV)
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=size,
                                **({} if timeout is None else {"timeout": timeout}))
        return cls(rank, size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """x: [..., w] this rank's split_range(total) of the last dim -> [..., total], every rank's in
        order (padded to the widest share for the collective, which wants equal shapes)."""
        import torch.distributed as dist

        from radianced.sharding import split_range

        widths = [b - a for a, b in (split_range(total, r, self.size) for r in range(self.size))]
        if x.shape[-1] != widths[self.rank]:
            raise ValueError(f"rank {self.rank} gathers {x.shape[-1]} of {total} columns; its share is {widths[self.rank]}")
        padded = torch.nn.functional.pad(x, (0, widths[0] - x.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded)
        return torch.cat([p[..., :w] for p, w in zip(parts, widths)], dim=-1)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
