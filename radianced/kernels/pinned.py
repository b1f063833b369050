"""Host memory pinned in place for CUDA: page-locked and mapped into the device's address space.

A kernel reads such memory by its host address over the link (the expert host pool in
kernels/moe.py, the embedding table in kernels/embedding.py), and copies from it run
asynchronously. `cudaHostRegister` pins memory the caller already owns (an mmap, a
tensor of exactly the size it needs); torch's `pin_memory()` would copy into its caching
host allocator, which rounds every block up to a power of two (a 593.5 MiB table would
take 1 GiB).
"""

from __future__ import annotations

import weakref

import torch

CUDA_HOST_REGISTER_PORTABLE, CUDA_HOST_REGISTER_MAPPED = 1, 2


class PinError(RuntimeError):
    """cudaHostRegister refused the memory; the message is CUDA's error."""


def register_pinned(owner: object, t: torch.Tensor, memory: object) -> weakref.finalize:
    """Pin `t`'s host memory in place for CUDA (page-locked, mapped into the device's address space:
    kernels read it over the link, copies from it run asynchronously) for as long as `owner` lives.

    Returns the finalizer that unpins it: call it to unpin early (`close`); it also runs when
    `owner` is collected unclosed. It holds `memory` (the mapping under t) until then, so pages are
    never unmapped while registered: CUDA would refuse a later registration of those addresses.
    Raises PinError with CUDA's error.
    """
    rt = torch.cuda.cudart()
    err = rt.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(),
                              CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED)
    if err != rt.cudaError.success:
        raise PinError(str(err))
    return weakref.finalize(owner, _unregister, t.data_ptr(), memory)


def _unregister(ptr: int, memory: object) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)  # `memory` was held alive until now
