"""A tile of a weight matrix in registers, whatever format its bytes are in: the one dequantizer the
Triton kernels share (kernels/moe.py's expert extents, kernels/linear.py's projections).

`weight_tile(piece, n, k, mask, N, K, FMT)` returns W[n, k] of a matrix W [N, K] that starts at
`piece`, FMT a constexpr (one specialization per format): "" for a typed pointer in the
activations' dtype, a plain `.rad` dtype ("bf16", "f16", "f32") over a byte pointer, or a compact
format (kernels/formats.py) dequantized in fp32 exactly as `kernels/dequant.py` does it (the
oracle): q8_0 d * q; q4_0 d * (q - 8); q4_1 d * q + m; fp8_b128 v * scale_inv of its 128 x 128
block. Callers round the tile to the activations' dtype before their dot, as the reference ops
round a dequantized weight (`compact.dense`). The product-only formats (q8_0, q4_0, fp8_b128) give
the very fp32 weights the reference does; q4_1's `d * q + m` may fuse into one FMA here where
numpy rounds twice (one fp32 rounding of the weight).

Byte offsets are int32: a matrix's bytes must stay under 2^31 (the callers check it).
"""

from __future__ import annotations

import triton
import triton.language as tl

# The compact formats it dequantizes are formats.COMPACT_TILES.
PLAIN_TILES = ("bf16", "f16", "f32")  # plain `.rad` dtypes it reads through a byte pointer


@triton.jit
def weight_tile(piece, n, k, mask, N, K, FMT: tl.constexpr):
    """W[n, k] ([BLOCK_N, BLOCK_K]; n [BLOCK_N], k [BLOCK_K] int32) of a matrix W [N, K] whose bytes start
    at `piece`, in format FMT, masked loads giving 0: the plain formats in their dtype, the compact ones
    in fp32. Layouts (kernels/formats.py): GGUF blocks of 32 values along a row (fp16 d [| fp16 m] | the
    values); fp8_b128 the fp32 scales [ceil(N/128), ceil(K/128)] first, then the E4M3 values row-major."""
    if FMT == "":
        return tl.load(piece + n[:, None] * K + k[None, :], mask=mask, other=0.0)
    elif FMT == "bf16":
        return tl.load(piece.to(tl.pointer_type(tl.bfloat16)) + n[:, None] * K + k[None, :], mask=mask, other=0.0)
    elif FMT == "f16":
        return tl.load(piece.to(tl.pointer_type(tl.float16)) + n[:, None] * K + k[None, :], mask=mask, other=0.0)
    elif FMT == "f32":
        return tl.load(piece.to(tl.pointer_type(tl.float32)) + n[:, None] * K + k[None, :], mask=mask, other=0.0)
    elif FMT == "fp8_b128":
        sk = (K + 127) // 128
        if k.shape[0] <= 128:  # a step along k from a multiple of its width: one scale block, one scale a row
            scale = tl.load((piece + ((n // 128) * sk + tl.min(k, axis=0) // 128) * 4).to(tl.pointer_type(tl.float32)),
                            mask=n < N, other=0.0)[:, None]
        else:  # whole rows (the gemv): a scale per value (a [BLOCK_N, BLOCK_K] fp32 gather, too big to pipeline)
            scale = tl.load((piece + ((n[:, None] // 128) * sk + k[None, :] // 128) * 4).to(tl.pointer_type(tl.float32)),
                            mask=mask, other=0.0)
        values = piece + ((N + 127) // 128) * sk * 4 + n[:, None] * K + k[None, :]
        v = tl.load(values.to(tl.pointer_type(tl.float8e4nv)), mask=mask, other=0.0).to(tl.float32)
        return v * scale
    elif FMT == "q8_0":
        block = _gguf_block(piece, n, k, K, 34)
        d = tl.load(block.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)
        q = tl.load((block + 2 + k[None, :] % 32).to(tl.pointer_type(tl.int8)), mask=mask, other=0).to(tl.float32)
        return q * d
    elif FMT == "q4_0":
        block = _gguf_block(piece, n, k, K, 18)
        d = tl.load(block.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)
        return d * (_nibble(block + 2, k, mask) - 8).to(tl.float32)
    else:
        tl.static_assert(FMT == "q4_1", "weight_tile reads q8_0, q4_0, q4_1, fp8_b128 and plain dtypes")
        block = _gguf_block(piece, n, k, K, 20)
        d = tl.load(block.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)
        m = tl.load((block + 2).to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)
        return d * _nibble(block + 4, k, mask).to(tl.float32) + m


@triton.jit
def _gguf_block(piece, n, k, K, BLOCK_BYTES: tl.constexpr):
    """Byte pointers [BLOCK_N, BLOCK_K] to the 32-value block holding W[n, k] (rows of K // 32 blocks)."""
    return piece + n[:, None] * (K // 32 * BLOCK_BYTES) + (k[None, :] // 32) * BLOCK_BYTES


@triton.jit
def _nibble(qs, k, mask):
    """Value k % 32 of a block's 16 bytes of nibbles at `qs` (int32 in [0, 16)): ggml puts values
    0..15 in the low nibbles of bytes 0..15 and values 16..31 in their high nibbles."""
    j = k[None, :] % 32
    byte = tl.load(qs + j % 16, mask=mask, other=0).to(tl.int32)
    return (byte >> ((j // 16) * 4)) & 0x0F


__all__ = ["PLAIN_TILES", "weight_tile"]
