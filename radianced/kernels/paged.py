"""The paged KV cache as the kernels see it: a layer's cache views, the address of a KV slot,
and the checks of a K/V write (shared by kernels/rope.py and kernels/attention.py).

A cache view for one layer is [P, N, S, Hkv, D]: P arena pages of N blocks of S
tokens; block id b lives at page b // N, position b % N inside the page (see
`reference.write_kv`). Views may be strided (the KV storage interleaves layers
and K/V), only the head dim must be contiguous. A flat slot is block * S + offset;
a slot < 0 (a padding row of the decode graphs) is written nowhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def slot_offset(slot, blocks_per_page, stride_p, stride_n, stride_s, BLOCK_SIZE: tl.constexpr):
    """Element offset of flat KV slot `slot` (block * S + offset, int64) in a [P, N, S, Hkv, D]
    cache view: block b at page b // N, position b % N."""
    block = slot // BLOCK_SIZE
    return (block // blocks_per_page) * stride_p + (block % blocks_per_page) * stride_n \
        + (slot % BLOCK_SIZE) * stride_s


def check_cache(name: str, cache: torch.Tensor, x: torch.Tensor) -> None:
    """Raise ValueError unless `cache` is a [P, N, S, Hkv, D] view on x's device, contiguous in D."""
    if cache.dim() != 5:
        raise ValueError(f"{name} must be [P, N, S, Hkv, D], got shape {tuple(cache.shape)}")
    if cache.device != x.device:
        raise ValueError(f"{name} is on {cache.device}, q on {x.device}")
    if cache.stride(4) != 1:
        raise ValueError(f"{name} must be contiguous in its head dim (stride {cache.stride(4)})")


def check_kv_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Raise ValueError unless k, v: [T, Hkv, D] fit the caches and slot_mapping is [T] on k's device."""
    check_cache("k_cache", k_cache, k)
    check_cache("v_cache", v_cache, k)
    t, hkv, d = k.shape
    if v.shape != k.shape or k_cache.shape[3:] != (hkv, d) or v_cache.shape != k_cache.shape:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} do not fit caches {tuple(k_cache.shape)}")
    if slot_mapping.shape != (t,) or slot_mapping.device != k.device:
        raise ValueError(f"slot_mapping must be [{t}] on {k.device}, got {tuple(slot_mapping.shape)} "
                         f"on {slot_mapping.device}")


__all__ = ["check_cache", "check_kv_write", "slot_offset"]
