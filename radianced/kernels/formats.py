"""Compact weight formats: what each one's bytes hold and how many there are.

A compact weight is a 2-D matrix W [N, K] (out features x in features, the
Hugging Face layout) stored in one of these byte layouts:

    q8_0   GGUF Q8_0: per 32 values of a row, fp16 d | 32 x int8 q;         w = d * q
    q4_0   GGUF Q4_0: per 32, fp16 d | 16 bytes of nibbles;                 w = d * (q - 8)
    q4_1   GGUF Q4_1: per 32, fp16 d | fp16 m | 16 bytes of nibbles;        w = d * q + m
    q4_k   GGUF Q4_K: per 256, fp16 d | fp16 dmin | 12 bytes of 6-bit scales and mins | 128 bytes of nibbles
    q5_k   GGUF Q5_K: per 256, as q4_k plus 32 bytes of fifth bits
    q6_k   GGUF Q6_K: per 256, 128 bytes low nibbles | 64 bytes high 2 bits | 16 int8 scales | fp16 d
    fp8_b128  Hugging Face block-scaled FP8 (DeepSeek-V3 / Qwen3 "-FP8" checkpoints): fp32
           `weight_scale_inv` [ceil(N/128), ceil(K/128)] first, then the E4M3 values [N, K] row-major,
           the extent padded to a multiple of 16 bytes; w = fp8 * scale_inv of its 128 x 128 block

The GGUF formats keep llama.cpp's block layouts byte for byte (ggml's
`block_q8_0` ... `block_q6_K`): every row is K / block values long, rows are
independent, so a row permutation (llama.cpp's Q/K rotary interleave) or a row
gather (an embedding lookup) works on the raw bytes, and a file's tensor is
copied into the `.rad` without touching a bit.

The K-quants keep their layout rather than being converted into one of ours.
A lossless conversion would have to carry, per 32 values, the product of the
fp16 super-block scale and the 6-bit sub-block scale; that product needs more
than fp16's 11 bits of mantissa (11 + 6), so Q4_0/Q4_1-style blocks cannot
hold it exactly, and Q6_K's 16-value sub-blocks do not fit a 32-value block at
all. Converting would either lose bits or grow the bytes (an fp32 scale and
min per 32 makes Q4_K 5.0 bits per weight instead of 4.5). Kept, they cost one
dequantizer each (`kernels/dequant.py`), which gguf's numpy code specifies.

fp8_b128 puts its scales before the values so both pieces stay aligned for
their element type whatever N x K is (the fp32 scales at the extent's start,
the one-byte values after), and pads to 16 bytes so the next piece of an
expert extent starts aligned too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FP8_BLOCK = 128  # fp8_b128's scale block: 128 x 128 values


@dataclass(frozen=True)
class WeightFormat:
    """One way of storing a tensor.

    name: the name the `.rad` header records (`TensorEntry.dtype`).
    torch_name: the torch dtype's name of a plain (dense) format (`dtype` resolves it, so the table
        imports no torch: the budget reads it); None for a compact one.
    block: values per block along a row (GGUF formats; 1 for dense and fp8_b128).
    block_bytes: bytes per block (the element size for dense formats).
    bits: average bits per weight, for receipts (scales included; fp8_b128's per 128 x 128 block).
    """

    name: str
    torch_name: str | None
    block: int
    block_bytes: int
    bits: float

    @property
    def dtype(self) -> torch.dtype | None:
        """The torch dtype of a plain format; None for a compact one."""
        import torch

        return None if self.torch_name is None else getattr(torch, self.torch_name)

    @property
    def compact(self) -> bool:
        return self.torch_name is None

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes a tensor of `shape` takes in this format; ValueError when the shape does not fit it."""
        if not self.compact:
            return math.prod(shape) * self.block_bytes
        if len(shape) != 2:
            raise ValueError(f"format {self.name} holds 2-D weights only, not shape {list(shape)}")
        n, k = shape
        if self.name == "fp8_b128":
            scales = math.ceil(n / FP8_BLOCK) * math.ceil(k / FP8_BLOCK)
            return _align16(4 * scales + n * k)
        if k % self.block:
            raise ValueError(f"format {self.name} needs rows of a multiple of {self.block} values, "
                             f"not {k} (shape {list(shape)})")
        return n * (k // self.block) * self.block_bytes

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of k values (row formats: the dense and the GGUF ones)."""
        if self.name == "fp8_b128":
            raise ValueError("fp8_b128 rows share their scales with 127 others; it has no row bytes")
        return k // self.block * self.block_bytes


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("f32", "float32", 1, 4, 32.0),
    WeightFormat("f16", "float16", 1, 2, 16.0),
    WeightFormat("bf16", "bfloat16", 1, 2, 16.0),
    WeightFormat("f8_e4m3", "float8_e4m3fn", 1, 1, 8.0),
    WeightFormat("q8_0", None, 32, 34, 8.5),
    WeightFormat("q4_0", None, 32, 18, 4.5),
    WeightFormat("q4_1", None, 32, 20, 5.0),
    WeightFormat("q4_k", None, 256, 144, 4.5),
    WeightFormat("q5_k", None, 256, 176, 5.5),
    WeightFormat("q6_k", None, 256, 210, 6.5625),
    WeightFormat("fp8_b128", None, 1, 1, 8.0 + 32 / FP8_BLOCK ** 2),
)}
COMPACT = tuple(name for name, f in FORMATS.items() if f.compact)
# The compact formats the Triton kernels dequantize in registers (kernels/weight_tiles.py); the K-quants are
# read on the CPU only. Here, not beside the kernels, so the loader checks a model without importing triton.
COMPACT_TILES = ("q8_0", "q4_0", "q4_1", "fp8_b128")
# The expert formats whose host-pool misses the card copies in before reading them (kernels/stage.py): their
# blocks (18, 20, 34 bytes) are not loaded in 16-byte runs where they lie. Named here for the budget (sizing.py).
STAGED_TILES = ("q8_0", "q4_0", "q4_1")
# The compact formats the host backend's block kernels read in place (kernels/cpu_blocks.py: every GGUF format,
# in cpu_blocks.c's order); fp8_b128 is dequantized per use on the CPU, a compact lm_head in it made dense at
# load (model/loader.py).
CPU_BLOCKS = ("q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k")


def expert_formats(name: str) -> tuple[str, str]:
    """(gate/up format, down format) of an expert extent's format name: "q4_k" for three pieces of one
    format, "q4_k+q6_k" when down differs (a GGUF Q4_K_M stores ffn_down_exps as Q6_K beside Q4_K
    gate/up stacks). ValueError for a name that is not one or two known formats."""
    parts = name.split("+")
    if len(parts) > 2 or any(p not in FORMATS for p in parts) or (len(parts) == 2 and parts[0] == parts[1]):
        raise ValueError(f"unknown expert format {name!r}")
    return parts[0], parts[-1]


def is_staged(name: str) -> bool:
    """Whether an expert format's misses are staged on the card (STAGED_TILES, both pieces)."""
    return all(p in STAGED_TILES for p in expert_formats(name))


def is_compact(name: str) -> bool:
    """Whether a tensor or expert format name (`expert_formats`) stores anything compact."""
    return any(FORMATS[p].compact for p in expert_formats(name))
