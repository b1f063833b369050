"""The math of the quantized KV formats (kernels/kv_formats.py says their bytes and why).

The reference of every quantized-KV kernel: `KVPlane.store` is what the fused
RoPE + store launch must write, `KVPlane.blocks` what the attention loops must
read; the CPU backend runs them as they are (batched over the step).
"""

from __future__ import annotations

import torch

from radianced.kernels.kv_formats import FP8_MAX, GROUP, PlaneFormat


def ieee_div(x: torch.Tensor, c: float) -> torch.Tensor:
    """x / c rounded once, as the Triton kernels' `div_rn` is, on every device: torch's CUDA kernel
    multiplies by the reciprocal of a Python-number divisor (two roundings), which moved an int6 step or
    an fp16 scale by one step now and then on the H200; a tensor divisor takes its true division."""
    return x / torch.full_like(x, c)


# -- fp8 ----------------------------------------------------------------------


def fp8_scale(x: torch.Tensor) -> torch.Tensor:
    """The fp16 scale [..., 1] of x [..., D]: amax / 448 rounded to fp16, one step up where the rounding
    went below (so x / scale never passes 448: nothing saturates); 0 for an all-zero x."""
    amax = x.float().abs().amax(-1, keepdim=True)
    scale = ieee_div(amax, FP8_MAX).to(torch.float16)
    up = torch.nextafter(scale, torch.full_like(scale, float("inf")))
    return torch.where(scale.float() * FP8_MAX < amax, up, scale)


def fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes uint8 [..., D] (E4M3 bits), fp16 scales [..., 1]), against the stored scale."""
    scale = fp8_scale(x)
    s = scale.float()
    y = torch.where(s > 0, x.float() / torch.where(s > 0, s, 1), 0).clamp(-FP8_MAX, FP8_MAX)
    return y.to(torch.float8_e4m3fn).view(torch.uint8), scale


def fp8_dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 values of codes [..., D] (uint8) with fp16 scales [..., 1]."""
    return codes.view(torch.float8_e4m3fn).float() * scales.float()


# -- int6 / int4 ---------------------------------------------------------------


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes q [..., D] (< 2**bits, any int dtype) packed into uint8 [..., code_bytes(D)]:
    int4 two to a byte (even dim low), int6 four to three bytes (24 bits little-endian, dim 0 lowest)."""
    per = 2 if bits == 4 else 4
    d = q.shape[-1]
    q = torch.nn.functional.pad(q.to(torch.int32), (0, -d % per)).view(*q.shape[:-1], -(-d // per), per)
    word = sum(q[..., i] << (bits * i) for i in range(per))  # [..., D / per]
    nbytes = per * bits // 8
    return torch.stack([(word >> (8 * i)) & 0xFF for i in range(nbytes)], -1).flatten(-2).to(torch.uint8)


def unpack(codes: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """`pack`'s inverse: int32 [..., d]."""
    per = 2 if bits == 4 else 4
    nbytes = per * bits // 8
    b = codes.to(torch.int32).view(*codes.shape[:-1], codes.shape[-1] // nbytes, nbytes)
    word = sum(b[..., i] << (8 * i) for i in range(nbytes))
    mask = (1 << bits) - 1
    return torch.stack([(word >> (bits * i)) & mask for i in range(per)], -1).flatten(-2)[..., :d]


def _grouped(x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """x [..., D] as [..., groups, GROUP] (padded with `fill`)."""
    d = x.shape[-1]
    return torch.nn.functional.pad(x, (0, -d % GROUP), value=fill).view(*x.shape[:-1], -(-d // GROUP), GROUP)


def int_quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (packed codes uint8 [..., code_bytes], fp16 scales [..., groups, 2]: each group's
    (step, min)). Asymmetric: codes 0..2**bits - 1 span the group's min..max. Step and min are rounded
    to fp16 first, so the codes are exact against what is stored."""
    top = (1 << bits) - 1
    d = x.shape[-1]
    x = x.float()
    lo = _grouped(x, float("inf")).amin(-1).to(torch.float16)  # [..., groups]
    step = ieee_div(_grouped(x, float("-inf")).amax(-1) - lo.float(), top).to(torch.float16)
    s, m = step.float()[..., None], lo.float()[..., None]
    q = torch.where(s > 0, (_grouped(x) - m) / torch.where(s > 0, s, 1), 0).round().clamp(0, top)
    return pack(q.flatten(-2)[..., :d], bits), torch.stack([step, lo], -1)


def int_dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """fp32 values [..., d] of packed codes with fp16 (step, min) [..., groups, 2]: q * step + min."""
    g = _grouped(unpack(codes, bits, d).float()) * scales[..., 0].float()[..., None] + scales[..., 1].float()[..., None]
    return g.flatten(-2)[..., :d]


def dct_basis(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal DCT-II matrix C [d, d] (fp32; C @ C.T = I): row k is sqrt(2/d) cos(pi (i + 1/2) k / d),
    row 0 divided by sqrt(2). A rotated plane stores x @ C.T, which spreads a channel's outlier over the
    head's dims before the int4 groups take their (step, min)."""
    k = torch.arange(d, dtype=torch.float64)[:, None]
    i = torch.arange(d, dtype=torch.float64)[None]
    c = torch.cos(torch.pi * (i + 0.5) * k / d) * (2 / d) ** 0.5
    c[0] /= 2 ** 0.5
    return c.to(device=device, dtype=torch.float32)


def quantize(fmt: PlaneFormat, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] in `fmt`, each row on its own: (codes uint8 [..., code_bytes], fp16 scales [..., 1] (fp8) or
    [..., groups, 2] (int))."""
    return fp8_quantize(x) if fmt.name == "fp8" else int_quantize(x, fmt.bits)


def dequantize(fmt: PlaneFormat, codes: torch.Tensor, scales: torch.Tensor, d: int) -> torch.Tensor:
    """`quantize`'s fp32 values [..., d]."""
    return fp8_dequantize(codes, scales) if fmt.name == "fp8" else int_dequantize(codes, scales, fmt.bits, d)


# -- a plane over the cache ------------------------------------------------------


class KVPlane:
    """One layer's K or V over every block of the cache, quantized: what the attention ops take in
    place of a plain [P, N, S, Hkv, D] cache view.

    codes: uint8 [P, N, S, Hkv, code_bytes]; scales: fp16 [P, N, S, Hkv, 1] (fp8) or
    [P, N, S, Hkv, groups, 2] (int); both views into the blocks' bytes.
    """

    def __init__(self, fmt: PlaneFormat, codes: torch.Tensor, scales: torch.Tensor, head_dim: int):
        self.fmt, self.codes, self.scales, self.head_dim = fmt, codes, scales, head_dim
        self.basis = dct_basis(head_dim, codes.device) if fmt.rotated else None

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """[P, N, S, Hkv, D]: the plain cache view's shape."""
        return (*self.codes.shape[:4], self.head_dim)

    def store(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize x [T, Hkv, D] into flat slots [T] (all >= 0, distinct). A delta plane stores a
        block's offset-0 tokens first, as themselves; every other token is the residual from its
        block's first token as stored (written now or by an earlier write): never re-quantized."""
        _, n, s = self.codes.shape[:3]
        block, off = slots // s, slots % s
        page, inside = block // n, block % n
        if self.basis is not None:
            x = x.float() @ self.basis.T
        if self.fmt.delta:
            first = off == 0
            self._put(page[first], inside[first], off[first], x[first])
            rest = ~first
            page, inside, off, x = page[rest], inside[rest], off[rest], x[rest].float()
            x = x - dequantize(self.fmt, self.codes[page, inside, 0], self.scales[page, inside, 0], self.head_dim)
        self._put(page, inside, off, x)

    def _put(self, page: torch.Tensor, inside: torch.Tensor, off: torch.Tensor, x: torch.Tensor) -> None:
        codes, scales = quantize(self.fmt, x)
        self.codes[page, inside, off] = codes
        self.scales[page, inside, off] = scales

    def blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """The dequantized blocks `blocks` [...] (flat ids): fp32 [..., S, Hkv, D]."""
        n = self.codes.shape[1]
        page, inside = blocks // n, blocks % n
        out = dequantize(self.fmt, self.codes[page, inside], self.scales[page, inside], self.head_dim)
        if self.fmt.delta:  # the first token's value is the others' base
            out[..., 1:, :, :] += out[..., :1, :, :]
        return out if self.basis is None else out @ self.basis
