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

`gguf_rows_products` is the MoE's few-rows path over GGUF blocks: the same fp32 weights, not
rounded, multiplied by x without a tile in k order (its docstring says why).

Byte offsets are int32: a matrix's bytes must stay under 2^31 (the callers check it).
"""

from __future__ import annotations

import triton
import triton.language as tl

# The compact formats it dequantizes are formats.COMPACT_TILES.
PLAIN_TILES = ("bf16", "f16", "f32")  # plain `.rad` dtypes it reads through a byte pointer
GGUF_TILES = ("q8_0", "q4_0", "q4_1")  # the compact formats of 32-value blocks (their steps: whole blocks)
# The widest step read block by block (`_gguf_tile`). Compiled for the H200, the gemv's whole rows (2,048 and
# 4,096 values: 64 and 128 blocks) came out wrong through it (every GGUF format, relative error 1.2-1.3: values
# summed against the wrong x) while the interpreter agreed with the oracle; steps of up to 512 (the MoE's
# 256, the linear dot's 512) were right. Wider steps read value by value (`_gguf_values`), as before.
BLOCK_PATH_MAX_K = tl.constexpr(512)


@triton.jit
def weight_tile(piece, n, k, mask, N, K, FMT: tl.constexpr):
    """W[n, k] ([BLOCK_N, BLOCK_K]; n [BLOCK_N], k [BLOCK_K] int32) of a matrix W [N, K] whose bytes start
    at `piece`, in format FMT, masked loads giving 0: the plain formats in their dtype, the compact ones
    in fp32. Layouts (kernels/formats.py): GGUF blocks of 32 values along a row (fp16 d [| fp16 m] | the
    values); fp8_b128 the fp32 scales [ceil(N/128), ceil(K/128)] first, then the E4M3 values row-major.

    What every caller passes (kernels/linear.py, kernels/moe.py), and the compact paths rely on: k is
    k0 + arange(BLOCK_K), BLOCK_K a power of two and k0 a multiple of it (a K loop's step, or 0 for
    the gemv's whole rows), and mask is (n < N)[:, None] & (k < K)[None, :]. The compact paths build
    their masks per block from n and k (the same elements), so a block is loaded whole or not at all."""
    if FMT == "":
        return tl.load(piece + n[:, None] * K + k[None, :], mask=mask, other=0.0)
    elif FMT == "bf16":
        return tl.load(piece.to(tl.pointer_type(tl.bfloat16)) + n[:, None] * K + k[None, :], mask=mask, other=0.0)
    elif FMT == "f16":
        return tl.load(piece.to(tl.pointer_type(tl.float16)) + n[:, None] * K + k[None, :], mask=mask, other=0.0)
    elif FMT == "f32":
        return tl.load(piece.to(tl.pointer_type(tl.float32)) + n[:, None] * K + k[None, :], mask=mask, other=0.0)
    elif FMT == "fp8_b128":
        return _fp8_b128_tile(piece, n, k, mask, N, K)
    elif k.shape[0] < 32 or k.shape[0] > BLOCK_PATH_MAX_K:  # a step inside one block, or the gemv's whole rows
        return _gguf_values(piece, n, k, mask, K, FMT)
    else:
        return _gguf_tile(piece, n, k, N, K, FMT)


@triton.jit
def _fp8_b128_tile(piece, n, k, mask, N, K):
    """fp8_b128's W[n, k]: the E4M3 values (a contiguous run of each row) times the fp32 scale of their
    128 x 128 block, the scale loaded once per row and 128-wide block of k, not once per value: a step
    of at most 128 from a multiple of its width stays inside one block (one scale a row); a wider one
    (the gemv's whole rows, or a 256-wide step) covers BLOCK_K / 128 whole blocks, its values reshaped
    [BLOCK_N, BLOCK_K / 128, 128] against scales [BLOCK_N, BLOCK_K / 128]. (A per-value fp32 gather,
    [BLOCK_N, BLOCK_K] of them, took 258 KB of shared memory at 4 pipeline stages on the H200.)"""
    BLOCK_N: tl.constexpr = n.shape[0]
    BLOCK_K: tl.constexpr = k.shape[0]
    sk = (K + 127) // 128
    scales = piece.to(tl.pointer_type(tl.float32))
    values = piece + ((N + 127) // 128) * sk * 4 + n[:, None] * K + k[None, :]
    v = tl.load(values.to(tl.pointer_type(tl.float8e4nv)), mask=mask, other=0.0).to(tl.float32)
    if BLOCK_K <= 128:
        scale = tl.load(scales + (n // 128) * sk + tl.min(k, axis=0) // 128, mask=n < N, other=0.0)
        return v * scale[:, None]
    else:
        SCALE_BLOCKS: tl.constexpr = BLOCK_K // 128
        kb = tl.min(tl.reshape(k, (SCALE_BLOCKS, 128)), axis=1) // 128  # [BLOCK_K / 128] scale columns
        scale = tl.load(scales + (n // 128)[:, None] * sk + kb[None, :],
                        mask=(n < N)[:, None] & (kb < sk)[None, :], other=0.0)
        return tl.reshape(tl.reshape(v, (BLOCK_N, SCALE_BLOCKS, 128)) * scale[:, :, None], (BLOCK_N, BLOCK_K))


@triton.jit
def _gguf_tile(piece, n, k, N, K, FMT: tl.constexpr):
    """A GGUF tile of whole blocks (BLOCK_K >= 32): [BLOCK_N, BLOCK_K / 32] blocks, each block's scale
    (and min) loaded once, its quants as one contiguous run, the values put in ggml's order in registers
    (join / permute / reshape), then reshaped to [BLOCK_N, BLOCK_K].

    Every load is of aligned 4-byte words: Triton's pipeliner only prefetches loads of at least 32
    bits through shared memory (`num_stages` steps ahead; cp.async moves 4, 8 or 16 bytes), and a
    narrower load waits on memory in its own step. q4_1's 20-byte blocks start 4-byte aligned (rows
    and pieces start at multiples of 4): d|m is one word, the 16 bytes of quants 4 more. q8_0's
    (34-byte) and q4_0's (18-byte) blocks start 2 mod 4 every other block, so their d and quants are
    read from the aligned words around them and shifted into place (`_aligned_words`). No wider
    alignment holds, so no tl.multiple_of hint is given: a wrong one would make cp.async read
    misaligned addresses."""
    BLOCK_N: tl.constexpr = n.shape[0]
    BLOCKS: tl.constexpr = k.shape[0] // 32
    BYTES: tl.constexpr = 34 if FMT == "q8_0" else (18 if FMT == "q4_0" else 20)
    kb = tl.min(tl.reshape(k, (BLOCKS, 32)), axis=1) // 32  # [BLOCKS] block columns (k0 / 32 + arange)
    ok = (n < N)[:, None] & (kb * 32 < K)[None, :]  # [BLOCK_N, BLOCKS]: whole blocks in or out
    block = piece + n[:, None] * (K // 32 * BYTES) + kb[None, :] * BYTES  # [BLOCK_N, BLOCKS] byte pointers
    if FMT == "q4_1":
        dm = tl.load(block.to(tl.pointer_type(tl.int32)), mask=ok, other=0)  # fp16 d (low half) | fp16 m
        q = _nibbles(_bytes(_words(block + 4, ok, 4)), BLOCK_N, BLOCKS)
        w = _f16(dm)[:, :, None] * q.to(tl.float32) + _f16(dm >> 16)[:, :, None]
    else:
        at = block.to(tl.int64)  # absolute addresses: a piece itself may start 2 mod 4 (an expert's up after gate)
        dword = tl.load((at & -4).to(tl.pointer_type(tl.int32)), mask=ok, other=0)
        d = _f16(dword >> ((at & 2) * 8).to(tl.int32))[:, :, None]  # d: the aligned word's low or high half
        if FMT == "q8_0":
            q = _bytes(_aligned_words(at + 2, ok, 8))  # [BLOCK_N, BLOCKS, 32] bytes
            w = ((q << 24) >> 24).to(tl.float32) * d  # each an int8, sign-extended
        else:
            tl.static_assert(FMT == "q4_0", "weight_tile reads q8_0, q4_0, q4_1, fp8_b128 and plain dtypes")
            w = d * (_nibbles(_bytes(_aligned_words(at + 2, ok, 4)), BLOCK_N, BLOCKS) - 8).to(tl.float32)
    return tl.reshape(w, (BLOCK_N, BLOCKS * 32))


@triton.jit
def _f16(bits):
    """The fp16 whose bits are the low half of int32 `bits`, as fp32."""
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _words(at, ok, WORDS: tl.constexpr):
    """WORDS consecutive int32 words from each 4-byte aligned byte pointer of `at` ([BLOCK_N, BLOCKS]),
    masked by ok: [BLOCK_N, BLOCKS, WORDS]."""
    words = at.to(tl.pointer_type(tl.int32))[:, :, None] + tl.arange(0, WORDS)[None, None, :]
    return tl.load(words, mask=ok[:, :, None], other=0)


@triton.jit
def _aligned_words(at, ok, WORDS: tl.constexpr):
    """The 4 * WORDS bytes from each address of `at` ([BLOCK_N, BLOCKS] int64, each 0 or 2 mod 4) as
    [BLOCK_N, BLOCKS, WORDS] int32 words, every load an aligned word: at 2 mod 4 word j is the high
    half of aligned word j and the low half of word j + 1 (loaded only there). The last of those
    also holds the 2 bytes after the run; it starts inside the run, so it lies in the run's page.
    (Likewise a block's d at 2 mod 4 is read with the 2 bytes before it: the row, or the piece of the
    extent, before it; a CompactWeight's own bytes start 16-byte aligned.)"""
    first = (at & -4).to(tl.pointer_type(tl.int32))[:, :, None] + tl.arange(0, WORDS)[None, None, :]
    odd = ((at & 2) != 0)[:, :, None]
    lo = tl.load(first, mask=ok[:, :, None], other=0)
    hi = tl.load(first + 1, mask=ok[:, :, None] & odd, other=0)
    return tl.where(odd, ((lo >> 16) & 0xFFFF) | (hi << 16), lo)


@triton.jit
def _bytes(words):
    """The bytes (int32 in [0, 256)) of little-endian int32 words in memory order: [..., W] words give
    [..., 4 * W] bytes (join(join(b0, b2), join(b1, b3))[..., p, q] is byte 2p + q)."""
    b = tl.join(tl.join(words & 0xFF, (words >> 16) & 0xFF), tl.join((words >> 8) & 0xFF, (words >> 24) & 0xFF))
    return tl.reshape(b, (words.shape[0], words.shape[1], words.shape[2] * 4))


@triton.jit
def _nibbles(qs, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr):
    """A block's 32 4-bit quants from its 16 bytes ([BLOCK_N, BLOCKS, 16] -> [BLOCK_N, BLOCKS, 32], int32
    in [0, 16)), in ggml's order: values 0..15 are the low nibbles of bytes 0..15, values 16..31 their
    high nibbles. join gives [..., byte, half]; permuted to [..., half, byte] it flattens to that order."""
    return tl.reshape(tl.permute(tl.join(qs & 0x0F, qs >> 4), (0, 1, 3, 2)), (BLOCK_N, BLOCKS, 32))


@triton.jit
def _gguf_values(piece, n, k, mask, K, FMT: tl.constexpr):
    """A GGUF tile narrower than a block (BLOCK_K = 16) or wider than BLOCK_PATH_MAX_K (the gemv's whole
    rows), value by value: each value's block address, scale and quant byte loaded for it (a gather per
    value)."""
    BYTES: tl.constexpr = 34 if FMT == "q8_0" else (18 if FMT == "q4_0" else 20)
    block = piece + n[:, None] * (K // 32 * BYTES) + (k[None, :] // 32) * BYTES
    d = tl.load(block.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)
    j = k[None, :] % 32
    if FMT == "q8_0":
        w = tl.load((block + 2 + j).to(tl.pointer_type(tl.int8)), mask=mask, other=0).to(tl.float32) * d
    else:
        QS: tl.constexpr = 2 if FMT == "q4_0" else 4
        q = (tl.load(block + QS + j % 16, mask=mask, other=0).to(tl.int32) >> ((j // 16) * 4)) & 0x0F
        if FMT == "q4_0":
            w = d * (q - 8).to(tl.float32)
        else:
            tl.static_assert(FMT == "q4_1", "weight_tile reads q8_0, q4_0, q4_1, fp8_b128 and plain dtypes")
            m = tl.load((block + 2).to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)
            w = d * q.to(tl.float32) + m
    return w


@triton.jit
def gguf_rows_products(piece, n, k0, x_rows, row_ok, N, K, FMT: tl.constexpr, BLOCKS: tl.constexpr):
    """The products x[m, k] * W[n, k] for k in [k0, k0 + 32 * BLOCKS) of a GGUF matrix W [N, K] whose
    bytes start at `piece`, unsummed: [BLOCK_M, BLOCK_N, BLOCKS, P] fp32 (P the 16-bit words of a
    block's quants: 8, or 16 for q8_0), x_rows [BLOCK_M] pointers to each row's x (masked by row_ok), n
    [BLOCK_N] int32, k0 a multiple of 32 * BLOCKS. Summed over its last two axes it is the K step's part
    of x . W[n]; a caller that adds the products of every step elementwise and sums once at the end
    keeps the reduction out of its loop.

    The few-rows path (decode) of the MoE: no tensor cores, so no dequantized tile is put in their
    operand layout (what `weight_tile` + tl.dot pays per value: the join / permute / reshape into k
    order and its layout conversions; on sm_90, 13 instructions a value at T = 1 against bf16's 1.2).
    Each block's quants are read as 16-bit words (q4_0's and q8_0's blocks start 2 mod 4; every block
    starts 2-aligned) and used where they lie: x is gathered to match them instead (word i of a q4
    block holds values 2i, 2i + 16, 2i + 1, 2i + 17 in its four nibbles; of a q8_0 block, values 2i and
    2i + 1). Each weight is the fp32 value `dequant.py` gives (q4_1's `d * q + m` may fuse, as in
    `weight_tile`), multiplied by x in fp32 without first rounding it to x's dtype, as the tensor-core
    path must: with bf16 activations this path is the more exact of the two by that rounding."""
    BYTES: tl.constexpr = 34 if FMT == "q8_0" else (18 if FMT == "q4_0" else 20)
    QS: tl.constexpr = 4 if FMT == "q4_1" else 2  # the quants' offset in a block
    P: tl.constexpr = 16 if FMT == "q8_0" else 8
    kb = k0 // 32 + tl.arange(0, BLOCKS)  # [BLOCKS] block columns
    kb_ok = kb * 32 < K
    ok = (n < N)[:, None] & kb_ok[None, :]  # [BLOCK_N, BLOCKS]
    block = piece + n[:, None] * (K // 32 * BYTES) + kb[None, :] * BYTES
    d = tl.load(block.to(tl.pointer_type(tl.float16)), mask=ok, other=0.0).to(tl.float32)[:, :, None]
    i = tl.arange(0, P)
    q = tl.load((block + QS).to(tl.pointer_type(tl.int16))[:, :, None] + i[None, None, :], mask=ok[:, :, None],
                other=0).to(tl.int32)  # [BLOCK_N, BLOCKS, P], sign-extended
    x_at = x_rows[:, None, None] + (kb * 32)[None, :, None] + 2 * i[None, None, :]  # value 2i of each block
    x_ok = row_ok[:, None, None] & kb_ok[None, :, None]
    if FMT == "q8_0":
        products = _times_x((q << 24) >> 24, d, 0.0, x_at, x_ok) + _times_x(q >> 8, d, 0.0, x_at + 1, x_ok)
    else:
        if FMT == "q4_0":
            shift = -8.0 * d  # d * q - 8 d = d * (q - 8), exactly: an fp16 d times at most 4 bits fits fp32
        else:
            tl.static_assert(FMT == "q4_1", "gguf_rows_products reads q8_0, q4_0 and q4_1")
            shift = tl.load((block + 2).to(tl.pointer_type(tl.float16)), mask=ok, other=0.0).to(tl.float32)
            shift = shift[:, :, None]
        products = (_times_x(q & 15, d, shift, x_at, x_ok) + _times_x((q >> 4) & 15, d, shift, x_at + 16, x_ok)
                    + _times_x((q >> 8) & 15, d, shift, x_at + 1, x_ok)
                    + _times_x((q >> 12) & 15, d, shift, x_at + 17, x_ok))
    return products


@triton.jit
def _times_x(q, scale, shift, x_at, x_ok):
    """[BLOCK_M, BLOCK_N, BLOCKS, P] products x * w, w = scale * q + shift in fp32 ([BLOCK_N, BLOCKS, P]
    int quants; scale, shift [BLOCK_N, BLOCKS, 1] or 0.0), x [BLOCK_M, BLOCKS, P] loaded from x_at."""
    x = tl.load(x_at, mask=x_ok, other=0.0).to(tl.float32)
    return x[:, None, :, :] * (q.to(tl.float32) * scale + shift)[None, :, :, :]


__all__ = ["GGUF_TILES", "PLAIN_TILES", "gguf_rows_products", "weight_tile"]
