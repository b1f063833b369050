"""The reference dequantizers: a compact format's bytes -> fp32 values (layouts in `formats.py`).

Each GGUF dequantizer is a torch transcription of `gguf.quants.<Type>.dequantize_blocks`
(the gguf package's numpy code, itself ggml's `dequantize_row_*`) and equals it bit
for bit: the same fp32 operations in the same order (a product then a sum, never
fused), so tests compare with `torch.equal`. fp8_b128's oracle is
`w.float() * scale_inv` per 128 x 128 block, which `dequantize_fp8_b128` is.

These run on any device torch runs on; the CPU backend calls them per use (one
weight at a time, `kernels/compact.py`), so weights stay compact in memory.
"""

from __future__ import annotations

import torch

from radianced.kernels.formats import FORMATS, FP8_BLOCK

QK_K = 256


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 -> [n, 1] fp32 (little-endian fp16 bytes)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """[n, m] uint8 -> [n, 2m] uint8: per `group` bytes, the low nibbles then the high ones (ggml's order)."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group) >> torch.tensor([0, 4], dtype=torch.uint8, device=qs.device).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(n, -1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:], 16).to(torch.int8) - 8
    return _f16(b[:, :2]) * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _nibbles(b[:, 4:], 16).float() + _f16(b[:, 2:4])


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins per block ([n, 8] uint8 each)."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_scaled(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """`d * sc * q - dmin * m` per 32-value sub-block; q: [n, 8, 32] fp32."""
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc.float()).reshape(n, -1, 1)
    dm = (_f16(b[:, 2:4]) * mn.float()).reshape(n, -1, 1)
    return (d * q - dm).reshape(n, QK_K)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_scaled(b, _nibbles(b[:, 16:], 32).reshape(b.shape[0], -1, 32).float())


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qh, qs = b[:, 16:16 + QK_K // 8], b[:, 16 + QK_K // 8:]
    low = _nibbles(qs, 32).reshape(n, -1, 32)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 1, 8, 1)
    high = ((qh.reshape(n, -1, 1, 32) >> shifts) & 0x01).reshape(n, -1, 32)
    return _k_scaled(b, (low | (high << 4)).float())


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh = b[:, :QK_K // 2], b[:, QK_K // 2:QK_K // 2 + QK_K // 4]
    scales, d = b[:, 3 * QK_K // 4:3 * QK_K // 4 + QK_K // 16], b[:, 3 * QK_K // 4 + QK_K // 16:]
    d = (_f16(d) * scales.contiguous().view(torch.int8).float()).reshape(n, QK_K // 16, 1)
    low = _nibbles(ql, 64).reshape(n, -1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    high = ((qh.reshape(n, -1, 1, 32) >> shifts) & 0x03).reshape(n, -1, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, QK_K // 16, -1).float()
    return (d * q).reshape(n, QK_K)


_BLOCKS = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_1": _q4_1, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k}


def dequantize_rows(data: torch.Tensor, fmt: str, k: int) -> torch.Tensor:
    """Rows of a GGUF-format matrix -> fp32. data: [N, row_bytes] uint8 (N any), k: values per row.
    Returns [N, k] fp32, equal bit for bit to `gguf.quants.dequantize` of the same bytes."""
    f = FORMATS[fmt]
    n = data.shape[0]
    blocks = data.reshape(-1, f.block_bytes)
    return _BLOCKS[fmt](blocks).reshape(n, k)


def split_fp8_b128(data: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_b128 bytes [nbytes] uint8 -> (values [N, K] float8_e4m3fn, scale_inv [ceil(N/128), ceil(K/128)] fp32),
    views of `data`."""
    n, k = shape
    sn, sk = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    scales = data[:4 * sn * sk].view(torch.float32).view(sn, sk)
    values = data[4 * sn * sk:4 * sn * sk + n * k].view(torch.float8_e4m3fn).view(n, k)
    return values, scales


def pack_fp8_b128(values: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The inverse of `split_fp8_b128`: fp8_b128 bytes (scales as fp32, then the values, zero-padded)."""
    n, k = values.shape
    scales = scale_inv.float().contiguous().view(torch.uint8).reshape(-1)
    data = torch.zeros(FORMATS["fp8_b128"].nbytes((n, k)), dtype=torch.uint8, device=values.device)
    data[:scales.numel()] = scales
    data[scales.numel():scales.numel() + n * k] = values.contiguous().view(torch.uint8).reshape(-1)
    return data


def dequantize_fp8_b128(values: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """values [N, K] fp8, scale_inv [ceil(N/128), ceil(K/128)] -> [N, K] fp32: each value times its block's
    scale (`w.float() * scale_inv` per 128 x 128 block)."""
    n, k = values.shape
    s = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return values.float() * s


def dequantize(data: torch.Tensor, fmt: str, shape: tuple[int, int]) -> torch.Tensor:
    """A whole compact matrix -> [N, K] fp32. data: its bytes (uint8, any shape holding exactly them)."""
    if fmt == "fp8_b128":
        return dequantize_fp8_b128(*split_fp8_b128(data.reshape(-1), shape))
    return dequantize_rows(data.reshape(shape[0], -1), fmt, shape[1])
