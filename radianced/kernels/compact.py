"""A weight kept in its compact bytes in memory, dequantized per use (the CPU path).

`CompactWeight` is what a `.rad` hands out for a tensor stored in a compact
format (`formats.py`) and what the reference ops accept wherever they take a
weight matrix: `reference.linear` and `silu_mlp` dequantize it to the
activations' dtype for the one call and drop the copy, so resident memory stays
at the compact bytes (SmolLM2-135M in Q4_1: 98 MB, not the 515 MiB of fp32).
An embedding lookup dequantizes only the rows it gathers.

Dequantizing per use costs a pass over the weight per call (12 ms for one Q4_1
3072 x 576 matrix on this CPU, more than an fp32 matmul over it). So the host backend's
linear (`kernels/cpu.py`) reads every GGUF format's bytes in place through its
block kernels (`cpu_blocks.py`: the same fp32 values, no second copy), while the reference
ops keep dequantizing per use (the oracle).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radianced.kernels.dequant import dequantize, dequantize_rows, split_fp8_b128
from radianced.kernels.formats import FORMATS, FP8_BLOCK


@dataclass(frozen=True)
class CompactWeight:
    """A matrix W [N, K] in a compact format.

    fmt: the format's name (a compact key of `formats.FORMATS`).
    shape: (N, K), the dense matrix's shape.
    data: its bytes (uint8), exactly `FORMATS[fmt].nbytes(shape)` of them: [N, row_bytes] for
        the GGUF formats, flat for fp8_b128. Often a zero-copy view of the `.rad`'s mapping.
    """

    fmt: str
    shape: tuple[int, int]
    data: torch.Tensor

    def __post_init__(self):
        expected = FORMATS[self.fmt].nbytes(self.shape)
        if self.data.dtype != torch.uint8 or self.data.numel() != expected:
            raise ValueError(f"{self.fmt} {list(self.shape)} needs {expected} bytes of uint8, "
                             f"got {self.data.numel()} of {self.data.dtype}")

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [N, K] matrix, computed now in fp32 and cast to `dtype`."""
        return dequantize(self.data, self.fmt, self.shape).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` ([...] int) of the dense matrix: [..., K] in `dtype`; only those rows are dequantized."""
        n, k = self.shape
        flat = ids.reshape(-1).long()
        if self.fmt == "fp8_b128":
            out = _fp8_rows(*split_fp8_b128(self.data.reshape(-1), self.shape), flat)
        else:
            out = dequantize_rows(self.data.reshape(n, -1)[flat], self.fmt, k)
        return out.to(dtype).reshape(*ids.shape, k)

    def to(self, device: torch.device | str) -> CompactWeight:
        """The bytes on `device`."""
        return CompactWeight(self.fmt, self.shape, self.data.to(device))


def _fp8_rows(values: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """fp32 rows of an fp8_b128 matrix: each gathered row times its row block's scales along K."""
    k = values.shape[1]
    s = scales[rows // FP8_BLOCK].float().repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return values[rows].float() * s


def cat_rows(parts: list[torch.Tensor | CompactWeight]) -> torch.Tensor | CompactWeight | RowStack:
    """Matrices stacked along N (Attention's [q | k | v]): `torch.cat` for dense parts, the
    bytes concatenated for GGUF parts of one format (their rows are independent), else a
    `RowStack` that dequantizes part by part (fp8_b128, whose scale blocks span 128 rows)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    fmts = {p.fmt if isinstance(p, CompactWeight) else None for p in parts}
    if len(fmts) == 1 and None not in fmts and "fp8_b128" not in fmts:
        k = parts[0].shape[1]
        data = torch.cat([p.data.reshape(p.shape[0], -1) for p in parts])
        return CompactWeight(parts[0].fmt, (data.shape[0], k), data)
    return RowStack(tuple(parts))


@dataclass(frozen=True)
class RowStack:
    """Matrices of one K stacked along N, each in its own format; dequantized part by part.

    parts: the matrices, top to bottom (dense tensors or `CompactWeight`s).
    """

    parts: tuple[torch.Tensor | CompactWeight, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.to(dtype) if isinstance(p, torch.Tensor) else p.dequantize(dtype) for p in self.parts])


def dense(weight: torch.Tensor | CompactWeight | RowStack, dtype: torch.dtype) -> torch.Tensor:
    """`weight` as a dense matrix for one op: a tensor passes as it is, a compact one is dequantized to `dtype`."""
    return weight if isinstance(weight, torch.Tensor) else weight.dequantize(dtype)
