"""The math of the quantized KV formats (kernels/kv_formats.py says their bytes and why).

The reference of every quantized-KV kernel: `KVPlane.store` is what the fused
RoPE + store launch must write, `KVPlane.blocks` what the attention loops must
read; the CPU backend runs them as they are (batched over the step).
"""

from __future__ import annotations

import torch

from radianced.kernels.kv_formats import FP8_HEADROOM, FP8_MAX, GROUP, PlaneFormat


def scale_dtype(fmt: PlaneFormat) -> torch.dtype:
    """fp32 for a scale per (block, head), fp16 for one per (token, head, group)."""
    return torch.float32 if fmt.block_scaled else torch.float16


# -- fp8 ----------------------------------------------------------------------


def fp8_block_scale(first: torch.Tensor) -> torch.Tensor:
    """The scale [..., Hkv] (fp32) of a block whose offset-0 token is `first` [..., Hkv, D]."""
    amax = first.float().abs().amax(-1)
    return torch.where(amax > 0, amax * (FP8_HEADROOM / FP8_MAX), torch.ones_like(amax))


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Codes (uint8, E4M3 bits) of x [..., D] with scale [...] (saturating at +-448)."""
    y = (x.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX)
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def fp8_dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of codes [..., D] (uint8) with scale [...]."""
    return codes.view(torch.float8_e4m3fn).float() * scale[..., None]


# -- int6 / int4 ---------------------------------------------------------------


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes q [..., D] (< 2**bits, any int dtype) packed into uint8 [..., code_bytes(D)]:
    int4 two to a byte (even dim low), int6 four to three bytes (24 bits little-endian, dim 0 lowest)."""
    per = 2 if bits == 4 else 4
    d = q.shape[-1]
    q = torch.nn.functional.pad(q.to(torch.int32), (0, -d % per)).view(*q.shape[:-1], -1, per)
    word = sum(q[..., i] << (bits * i) for i in range(per))  # [..., D / per]
    nbytes = per * bits // 8
    return torch.stack([(word >> (8 * i)) & 0xFF for i in range(nbytes)], -1).flatten(-2).to(torch.uint8)


def unpack(codes: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """`pack`'s inverse: int32 [..., d]."""
    per = 2 if bits == 4 else 4
    nbytes = per * bits // 8
    b = codes.to(torch.int32).view(*codes.shape[:-1], -1, nbytes)
    word = sum(b[..., i] << (8 * i) for i in range(nbytes))
    mask = (1 << bits) - 1
    return torch.stack([(word >> (bits * i)) & mask for i in range(per)], -1).flatten(-2)[..., :d]


def _grouped(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as [..., groups, GROUP] (zero-padded)."""
    d = x.shape[-1]
    return torch.nn.functional.pad(x, (0, -d % GROUP)).view(*x.shape[:-1], -1, GROUP)


def int_quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (packed codes uint8 [..., code_bytes], fp16 scales [..., groups]). The scale is
    amax / qmax rounded to fp16 first, so the codes are exact against the scale that is stored."""
    qmax = (1 << (bits - 1)) - 1
    d = x.shape[-1]
    g = _grouped(x.float())
    scale = (g.abs().amax(-1) / qmax).to(torch.float16)  # [..., groups]
    s = scale.float()[..., None]
    q = torch.where(s > 0, g / torch.where(s > 0, s, 1), 0).round().clamp(-qmax, qmax)
    q = q.flatten(-2)[..., :d].to(torch.int32) + (qmax + 1)
    return pack(q, bits), scale


def int_dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """fp32 values [..., d] of packed codes with fp16 scales [..., groups]."""
    q = unpack(codes, bits, d) - (1 << (bits - 1))
    g = _grouped(q.float()) * scales.float()[..., None]
    return g.flatten(-2)[..., :d]


# -- a plane over the cache ------------------------------------------------------


class KVPlane:
    """One layer's K or V over every block of the cache, quantized: what the attention ops take in
    place of a plain [P, N, S, Hkv, D] cache view.

    codes: uint8 [P, N, S, Hkv, code_bytes]; scales: [P, N, Hkv] fp32 (fp8) or
    [P, N, S, Hkv, groups] fp16 (int); both views into the blocks' bytes.
    """

    def __init__(self, fmt: PlaneFormat, codes: torch.Tensor, scales: torch.Tensor, head_dim: int):
        self.fmt, self.codes, self.scales, self.head_dim = fmt, codes, scales, head_dim

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """[P, N, S, Hkv, D]: the plain cache view's shape."""
        return (*self.codes.shape[:4], self.head_dim)

    def store(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize x [T, Hkv, D] into flat slots [T] (all >= 0, distinct). An fp8 block takes its scale
        from its token at offset 0 when that token is among these (set first, so the block's other
        tokens here use it); a block begun by an earlier write keeps its scale."""
        _, n, s = self.codes.shape[:3]
        block, off = slots // s, slots % s
        page, inside = block // n, block % n
        if self.fmt.block_scaled:
            first = off == 0
            self.scales[page[first], inside[first]] = fp8_block_scale(x[first])
            self.codes[page, inside, off] = fp8_quantize(x, self.scales[page, inside])
        else:
            codes, scales = int_quantize(x, self.fmt.bits)
            self.codes[page, inside, off] = codes
            self.scales[page, inside, off] = scales

    def blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """The dequantized blocks `blocks` [...] (flat ids): fp32 [..., S, Hkv, D]."""
        n = self.codes.shape[1]
        page, inside = blocks // n, blocks % n
        codes, scales = self.codes[page, inside], self.scales[page, inside]
        if self.fmt.block_scaled:
            return fp8_dequantize(codes, scales[..., None, :])
        return int_dequantize(codes, scales, self.fmt.bits, self.head_dim)
