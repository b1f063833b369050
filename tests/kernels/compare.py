"""Shared helpers of the kernel tests (CPU interpreter and GPU): how far a kernel's output is
from its reference."""

from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in fp32."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def f32(x: torch.Tensor) -> torch.Tensor:
    """x as fp32 on the CPU: the reference's input."""
    return x.float().cpu()
