"""The paged KV cache as the kernels see it: a layer's cache views, the address of a KV slot,
and the checks of a K/V write (shared by kernels/rope.py and kernels/attention.py).

A cache view for one layer is [P, N, S, Hkv, D]: P arena pages of N blocks of S
tokens; block id b lives at page b // N, position b % N inside the page (see
`reference.write_kv`). Views may be strided (the KV storage interleaves layers
and K/V), only the head dim must be contiguous. A flat slot is block * S + offset;
a slot < 0 (a padding row of the decode graphs) is written nowhere.

A quantized cache (`--kv-cache-dtype`, kernels/kv_formats.py) comes as two
`kv_quant.KVPlane`s; the kernels take its codes as the views above (uint8, the
head dim's bytes contiguous) and its per-token scales beside them (`CacheViews`).
Of the formats, only `fp8` has Triton kernels (kernels/kv_fp8.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radianced.kernels.kv_formats import FP8, FP8_DELTA, KV_FORMATS
from radianced.kernels.kv_quant import KVPlane


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
                   slot_mapping: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
    """Raise ValueError unless k, v: [T, Hkv, D] fit the caches and slot_mapping is [T] on k's device.
    shape: the caches' [P, N, S, Hkv, D] where k_cache and v_cache are packed codes of other widths
    (kernels/kv_int.py's planes: fewer bytes than D, K's and V's differing); None: k_cache's own, v_cache's
    the same."""
    check_cache("k_cache", k_cache, k)
    check_cache("v_cache", v_cache, k)
    t, hkv, d = k.shape
    same = v_cache.shape == k_cache.shape if shape is None else v_cache.shape[:4] == k_cache.shape[:4]
    shape = tuple(k_cache.shape) if shape is None else tuple(shape)
    if v.shape != k.shape or shape[3:] != (hkv, d) or not same:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} do not fit caches {shape}")
    if slot_mapping.shape != (t,) or slot_mapping.device != k.device:
        raise ValueError(f"slot_mapping must be [{t}] on {k.device}, got {tuple(slot_mapping.shape)} "
                         f"on {slot_mapping.device}")


@dataclass(frozen=True)
class CacheViews:
    """A layer's K and V as the Triton kernels take them.

    k, v: [P, N, S, Hkv, D] views: values in the activations' dtype (auto), or an fp8 cache's E4M3
        codes as uint8 (K as the residual from its block's first token: kernels/kv_formats.py).
    k_scales, v_scales: an fp8 cache's fp16 scales [P, N, S, Hkv, 1], one per token and head; None
        for auto.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor | None = None
    v_scales: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        return self.k_scales is not None

    def scale_args(self) -> tuple:
        """The kernels' scale arguments: the two scale views and their [P, N, S, Hkv] strides (auto: the
        value views and zero strides, unused)."""
        if self.k_scales is None:
            return (self.k, self.v) + (0,) * 8
        return (self.k_scales, self.v_scales, *self.k_scales.stride()[:4], *self.v_scales.stride()[:4])


def cache_views(k_cache: torch.Tensor | KVPlane, v_cache: torch.Tensor | KVPlane) -> CacheViews:
    """The views of a layer's caches (tensors: auto; `KVPlane`s: a quantized cache). ValueError for an
    fp8_v4 or k6_v4 pair of planes (kv_int.kernel_cache's) or a mixed one."""
    if not isinstance(k_cache, KVPlane) and not isinstance(v_cache, KVPlane):
        return CacheViews(k_cache, v_cache)
    if not isinstance(k_cache, KVPlane) or not isinstance(v_cache, KVPlane) or (k_cache.fmt, v_cache.fmt) != \
            (FP8_DELTA, FP8):
        name = next((f.name for f in KV_FORMATS.values() if (f.k, f.v) == (getattr(k_cache, "fmt", None),
                                                                          getattr(v_cache, "fmt", None))), "mixed")
        raise ValueError(f"kv cache dtype {name}: paged.cache_views takes auto and fp8 caches, "
                         "kv_int.kernel_cache fp8_v4 and k6_v4; a K and a V of two formats are no format")
    return CacheViews(k_cache.codes, v_cache.codes, k_cache.scales, v_cache.scales)


__all__ = ["CacheViews", "cache_views", "check_cache", "check_kv_write", "slot_offset"]
