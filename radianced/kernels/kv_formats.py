"""Quantized KV cache formats (`--kv-cache-dtype fp8 | fp8_v4 | k6_v4`): their bytes and their math.

A format stores K and V of each full-attention layer as *planes*, each in one of

    fp8    E4M3 codes, one fp16 scale per (token, head): x = fp8 * scale, scale = amax / 448
           (rounded up to fp16: nothing saturates)
    int6   asymmetric 6-bit codes 0..63, 4 to 3 bytes little-endian, an fp16 (step, min) per
           (token, head, group of 32 dims): x = q * step + min
    int4   asymmetric 4-bit codes 0..15, 2 to a byte, the even dim in the low nibble, an fp16
           (step, min) per (token, head, group of 32 dims)

Every K plane is a *delta* plane: a block's token at offset 0 is stored as itself,
each later token of the block as its residual from that first token's stored value
(K = first + residual on read). The int4 V plane is *rotated*: each token-head is
stored as x @ C.T, C the orthonormal DCT-II basis (`kv_quant.dct_basis`), and read
back as y @ C; attention is linear in V, so a kernel may apply `@ C` once to its
output instead. Bytes per token and head, against fp8:

    fp8     K fp8 delta,  V fp8            D + 2 + D + 2         (bf16: 4D; 1.94x at D 64, 1.98x at 256)
    fp8_v4  K fp8 delta,  V int4 rotated   0.80 of fp8 at D 64, 0.81 at D 256
    k6_v4   K int6 delta, V int4 rotated   0.73 of fp8 at D 64, 0.74 at D 256

Every scale belongs to one token of one block, known when the token is written:
a block is shared by every sequence whose prefix hashes to it, so nothing in it may
belong to a sequence, and nothing is ever re-quantized (a delta token's base is its
own block's first token, written before it; within one launch the first token is
the one at slot - offset, so a fused kernel can compute its stored value without a
race). In the attention loop K's base adds one dot product per block: q.k_j =
q.first + scale_j * (q.codes_j) for fp8, the scale folded into the logit.

Why these, measured with `radiancectl quality --kv-cache-dtype` on SmolLM2-135M
(fp32) over typing_extensions' LICENSE (3,768 tokens, 8 teacher-forced windows,
against the `auto` cache); mean KL / top-1:
- The first rule (fp8 scale per (block, head) from the block's offset-0 token, with
  16x headroom) gave 0.0161 / 94.0% and failed the capital-of-France chat. The
  attention-sink token at position 0 was blamed; measured, its K and V are not
  extreme but small (K amax 0.1x-1.3x the other tokens' median, V 0.05x-3x), so block
  0's later V tokens saturated (up to 40x the sink's amax). A scale per token fixes
  that: 0.0129 / 94.6% (keeping token 0 unquantized on top: 0.0122, so the sink's
  own rounding is not the harm).
- K is what is left: fp8 per-token K alone 0.0122, V alone 0.0014. Post-RoPE K has
  channels that barely move (the slow RoPE pairs: mean up to +-13 with a std of ~1.3,
  |mean|/std up to 10), and E4M3's 3-bit mantissa rounds a value of 13 in steps of 1,
  all noise on the part that varies. K as the residual from the block's first token
  (16 neighbouring positions, so the slow channels cancel): K alone 0.0057; with an
  fp16 copy of the first token as the base (2D bytes per block more) 0.0048, not
  worth its bytes; a window-mean base 0.0093 (pre-RoPE quantization 0.0088, a
  Hadamard rotation of K 0.0083, rotation + delta 0.0046: the rotation costs a q
  rotation in every kernel for 0.001). fp8 as kept: 0.0070 / 95.7% (the bar:
  <= 0.01, >= 95%).
- V int4 dominates the narrow formats: symmetric (amax / 7, the first rule) V alone
  0.0281; MSE-searched clipping 0.0328; symmetric in groups of 16 (the same 5 bits a
  value as asymmetric in 32) 0.0199; asymmetric (step and min) 0.0167 for 2 bytes per
  32 dims more (0.0099 at 16 dims, but that is 6 bits a value); asymmetric in a
  Hadamard basis 0.0131, in the DCT basis 0.0125 (kept: the DCT has every size,
  Hadamard only powers of two); token 0 unquantized on top of asymmetric 0.0145.
  K int6: symmetric 0.0144, delta 0.0065, delta + asymmetric 0.0037. As kept:
  fp8_v4 0.0175 / 93.5%, k6_v4 0.0159 / 93.6% (first rule: 0.0425, 0.0421); neither
  reaches fp8's bar.
- For scale: bf16 0.00008; int8 with a scale per 32 (llama.cpp's q8_0 KV, published
  0.00098) 0.00108 here.

This module is the bytes (what the budget charges, no torch); kernels/kv_quant.py is
the math (quantize, dequantize, a plane over the cache); kernels/kv_fp8.py is fp8's
in the Triton kernels (kernels/kv_int.py the int planes'). Blocks are laid out by
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
    rotated: each token-head is stored in the orthonormal DCT-II basis (`x @ C.T`; read back `y @ C`):
        int4 V (see the module docstring). Attention is linear in V, so a kernel may instead apply `@ C`
        once to its output.
    """

    name: str
    bits: int
    delta: bool = False
    rotated: bool = False

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


FP8, INT4_ROTATED = PlaneFormat("fp8", 8), PlaneFormat("int4", 4, rotated=True)
FP8_DELTA, INT6_DELTA = PlaneFormat("fp8", 8, delta=True), PlaneFormat("int6", 6, delta=True)
_K = "K as the residual from its block's first token"
_INT = f"an fp16 step and min per token, head and {GROUP} dims"
_V4 = "V in the DCT basis"
KV_FORMATS = {
    "fp8": KVFormat("fp8", FP8_DELTA, FP8, f"fp8 E4M3, an fp16 scale per token and head; {_K}"),
    "fp8_v4": KVFormat("fp8_v4", FP8_DELTA, INT4_ROTATED,
                       f"K fp8 E4M3 with an fp16 scale per token and head, V int4 with {_INT}; {_K}; {_V4}"),
    "k6_v4": KVFormat("k6_v4", INT6_DELTA, INT4_ROTATED, f"K int6 and V int4, {_INT}; {_K}; {_V4}"),
}
