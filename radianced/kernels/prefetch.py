"""Warm L2 with the next op's weights while a latency-bound launch runs.

A b1 decode layer alternates weight streams (the projections, the experts) with
launches that move almost no bytes: the attention over a 1K context reads 2 MB
in ~10 us, a chain of dependent loads that leaves HBM idle. The attention
launch's programs can spend that idle time for the op after it: each issues
bulk L2 prefetches (Hopper's `cp.async.bulk.prefetch.L2`, one instruction per
thread for a whole piece, fire and forget: nothing waits for it, no register
holds the data) of its share of o_proj's weight, so o_proj's gemv then reads
L2 instead of HBM. CUTLASS's low-latency GEMM does the same with its own
weights while it waits on the kernel before it.

A prefetch is a hint: it changes no result, only where the next op's loads
hit. Off (`Prefetch.none()`) without CUDA compute capability 9.0, under the
Triton interpreter, for a tensor whose address or size is not a multiple of 16
bytes, or with `RADIANCED_L2_PREFETCH=0` (the A/B switch of the benchmarks).

A kernel that prefetches takes `pf_ptr, pf_bytes, pf_piece` and `PREFETCH:
tl.constexpr`, and calls `l2(pf_ptr, pf_bytes, pf_piece, index, LANES,
PREFETCH)` once per program, with LANES = its threads (32 x num_warps): the
program's lanes then prefetch pieces index * LANES .. index * LANES + LANES - 1,
one each. The launcher passes `*pf.args(dummy)` and `PREFETCH=pf.on` for
`pf = Prefetch.of(tensor, programs, lanes)`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ALIGN = 16  # bytes: cp.async.bulk's address and size granularity


LINE = 128  # bytes: an L2 line, what `prefetch.global.L2` fetches
MODES = (0, 1, 2)  # off, bulk (cp.async.bulk.prefetch.L2, a piece per thread), lines (prefetch.global.L2)


@functools.cache
def _mode(device: torch.device) -> int:
    raw = os.environ.get("RADIANCED_L2_PREFETCH", "1")
    if raw not in {str(m) for m in MODES}:
        raise ValueError(f"RADIANCED_L2_PREFETCH={raw!r}: use 1 (bulk), 2 (lines) or 0 (off)")
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    return int(raw) if torch.cuda.get_device_capability(device)[0] >= 9 else 0


def mode(device: torch.device) -> int:
    """How launches on `device` prefetch, 0: they do not (module docstring)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _mode(device)


@dataclass(frozen=True)
class Prefetch:
    """Bytes [ptr, ptr + nbytes), `mode` 1: in pieces of `piece` bytes (a multiple of ALIGN), one a
    thread, `programs * lanes` of them covering the range, the last ones overlapping the end;
    mode 2: a share of `piece` bytes (a multiple of LINE) a program, fetched a line a thread at a
    time. Mode 0: off."""

    ptr: torch.Tensor | None
    nbytes: int
    piece: int
    mode: int

    @staticmethod
    def none() -> Prefetch:
        return Prefetch(None, 0, ALIGN, 0)

    @staticmethod
    def of(tensor: torch.Tensor | None, programs: int, lanes: int) -> Prefetch:
        """`tensor`'s bytes (contiguous) split over `programs` programs of `lanes` threads, or
        none (off, no tensor, a non-contiguous one, or not 16-byte aligned)."""
        m = 0 if tensor is None else mode(tensor.device)
        if m == 0 or not tensor.is_contiguous():
            return Prefetch.none()
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < LINE or nbytes % ALIGN or tensor.data_ptr() % ALIGN:
            return Prefetch.none()
        unit = ALIGN if m == 1 else LINE
        pieces = programs * lanes if m == 1 else programs
        piece = triton.cdiv(triton.cdiv(nbytes, pieces), unit) * unit
        return Prefetch(tensor, nbytes, min(piece, nbytes // unit * unit), m)

    @property
    def on(self) -> int:
        """The kernel's PREFETCH (the mode)."""
        return self.mode

    def args(self, dummy: torch.Tensor) -> tuple:
        """(pf_ptr, pf_bytes, pf_piece); `dummy` stands for the pointer when off (never read)."""
        return dummy if self.ptr is None else self.ptr, self.nbytes, self.piece


@triton.jit
def l2(pf_ptr, pf_bytes, pf_piece, index, LANES: tl.constexpr, PREFETCH: tl.constexpr):
    """Program `index`'s part of the range into L2 (module docstring); nothing when PREFETCH is 0."""
    if PREFETCH == 1:
        lane = index * LANES + tl.arange(0, LANES)
        start = tl.minimum(lane.to(tl.int64) * pf_piece, pf_bytes - pf_piece)
        addr = pf_ptr.to(tl.int64) + start
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                  [addr, pf_piece.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    if PREFETCH == 2:
        first = index.to(tl.int64) * pf_piece
        for line in range(0, pf_piece, LANES * 128):
            start = tl.minimum(first + line + tl.arange(0, LANES).to(tl.int64) * 128, pf_bytes - 128)
            addr = pf_ptr.to(tl.int64) + start
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                      [addr], dtype=tl.int32, is_pure=False, pack=1)


__all__ = ["Prefetch", "mode", "l2"]
