"""Quantized KV cache formats (`--kv-cache-dtype fp8 | fp8_v4 | k6_v4`): their bytes and their math.

A format stores K and V of each full-attention layer as *planes*, each in one of

    fp8    E4M3 codes, one fp32 scale per (block, head): x = fp8 * scale
    int6   symmetric 6-bit ints in offset binary (q + 32), 4 to 3 bytes little-endian,
           one fp16 scale per (token, head, group of 32 dims): x = (q - 32) * scale, |q - 32| <= 31
    int4   symmetric 4-bit ints (q + 8), 2 to a byte, the even dim in the low nibble,
           one fp16 scale per (token, head, group of 32 dims): x = (q - 8) * scale, |q - 8| <= 7

    fp8     K fp8,  V fp8      (half of bf16's bytes)
    fp8_v4  K fp8,  V int4     (25/32 of fp8's bytes at head dim 256, 0.79 at SmolLM2's 64)
    k6_v4   K int6, V int4     (22/32 of fp8's bytes at head dim 256)

The scale granularity is what makes the prefix cache work: a block is shared by
every sequence whose prefix hashes to it, so its scales must belong to the block,
never to a sequence. The int planes carry a scale per token (llama.cpp's q4_0 /
q8_0 KV layout: 2 bytes per 32 values), known when the token is written, so a
block never changes after its token is stored. The fp8 plane's scale per (block,
head) is set by the token at the block's offset 0 (`FP8_HEADROOM` times its amax
maps to E4M3's 448) and every later token of the block is quantized with it,
saturating past it: no token is ever re-quantized, and within one launch the
block's first token is the one at slot - offset, so a fused kernel can compute it
without a race.

Measured with `radiancectl quality --kv-cache-dtype` on SmolLM2-135M (fp32) over
typing_extensions' LICENSE (3,768 tokens, 8 teacher-forced windows, against the
`auto` cache); mean KL / p99 KL / top-1:
    first-token scale, headroom 1   0.2908 / 2.460 / 74.3%  (later tokens saturate)
    first-token scale, headroom 4   0.0308 / 0.344 / 92.4%
    first-token scale, headroom 16  0.0160 / 0.172 / 93.9%  (kept)
    static scale 1 per (layer, head) (vLLM's uncalibrated default)  0.0195 / 0.210 / 92.8%
    K int6 + V int6 (group scales, no saturation at all)            0.0163 / 0.161 / 93.5%
    bf16 cache (8 mantissa bits against fp8's 3)                    0.00008 / 0.0009 / 99.5%
At headroom 16 what is left is E4M3's 3-bit mantissa itself: fp8 K with int6 V and
int6 K with fp8 V both give 0.016, the same as int6 for both. SmolLM2-135M misses
the issue's fp8 bar (mean KL <= 0.01, top-1 >= 95%) by that rounding, not by the
scale rule.

This module is the bytes (what the budget charges, no torch); kernels/kv_quant.py is
the math (quantize, dequantize, a plane over the cache). Blocks are laid out by
`KVFormat.layer_bytes`: per layer [K codes | V codes | K scales | V scales], each
piece 4-byte aligned, all layers of a block one after the other, so a quantized
block stays one contiguous piece of an arena page.
"""

from __future__ import annotations

from dataclasses import dataclass

FP8_MAX = 448.0  # E4M3's largest finite value
GROUP = 32  # dims per scale of an int plane


def _align4(n: int) -> int:
    return -(-n // 4) * 4


@dataclass(frozen=True)
class PlaneFormat:
    """How one of K or V is stored.

    name: "fp8", "int6" or "int4" (the module docstring gives each one's layout).
    bits: bits per element.
    delta: a block's tokens after its first are stored as their residual from the first token's
        dequantized value (K planes: see the module docstring); the first token is stored as itself.
    """

    name: str
    bits: int
    delta: bool = False

    def code_bytes(self, d: int) -> int:
        """Bytes of one token's codes of one head of `d` dims (the packing pads the last byte)."""
        return {"fp8": d, "int6": 3 * -(-d // 4), "int4": -(-d // 2)}[self.name]

    def scale_shape(self, s: int, hkv: int, d: int) -> tuple[int, ...]:
        """The fp16 scales of one block of `s` tokens: [S, Hkv, 1] for fp8 (a float format needs no finer
        one), [S, Hkv, groups, 2] (step and min of each GROUP dims) for an int plane."""
        return (s, hkv, 1) if self.name == "fp8" else (s, hkv, -(-d // GROUP), 2)

    def scale_bytes(self, s: int, hkv: int, d: int) -> int:
        n = 2
        for x in self.scale_shape(s, hkv, d):
            n *= x
        return n


@dataclass(frozen=True)
class KVFormat:
    """A `--kv-cache-dtype` other than auto.

    name: the flag value. k, v: how K and V are stored.
    describe: the receipt's words for it.
    """

    name: str
    k: PlaneFormat
    v: PlaneFormat
    describe: str

    def pieces(self, s: int, hkv: int, d: int) -> tuple[tuple[int, int], ...]:
        """(offset, bytes) inside one layer of a block of K codes, V codes, K scales, V scales."""
        sizes = (s * hkv * self.k.code_bytes(d), s * hkv * self.v.code_bytes(d),
                 self.k.scale_bytes(s, hkv, d), self.v.scale_bytes(s, hkv, d))
        out, at = [], 0
        for n in sizes:
            out.append((at, n))
            at += _align4(n)
        return tuple(out)

    def layer_bytes(self, s: int, hkv: int, d: int) -> int:
        at, n = self.pieces(s, hkv, d)[-1]
        return at + _align4(n)

    def block_bytes(self, layers: int, s: int, hkv: int, d: int) -> int:
        """One block of `s` tokens of all `layers` layers: what the receipt charges and the cache allocates."""
        return layers * self.layer_bytes(s, hkv, d)


FP8, INT4 = PlaneFormat("fp8", 8), PlaneFormat("int4", 4)
FP8_DELTA, INT6_DELTA = PlaneFormat("fp8", 8, delta=True), PlaneFormat("int6", 6, delta=True)
_K = "K as the residual from its block's first token"
_INT = f"an fp16 step and min per token, head and {GROUP} dims"
KV_FORMATS = {
    "fp8": KVFormat("fp8", FP8_DELTA, FP8, f"fp8 E4M3, an fp16 scale per token and head; {_K}"),
    "fp8_v4": KVFormat("fp8_v4", FP8_DELTA, INT4, f"K fp8 E4M3 with an fp16 scale per token and head, V int4 with "
                                                  f"{_INT}; {_K}"),
    "k6_v4": KVFormat("k6_v4", INT6_DELTA, INT4, f"K int6 and V int4, {_INT}; {_K}"),
}
