"""Programmatic dependent launch (Hopper): a kernel's launch overlaps the end of the one before it.

A b1 decode step is ~100 short kernels, and between two of them in a CUDA graph
the device idles about a microsecond (the next grid's launch, its first loads
in flight). Launched with `launch_pdl=True`, a kernel's programs may start
while the previous kernel's last programs still run; they may read at once
what no earlier kernel of the step writes (weights: the gemv issues its weight
loads first), and must `wait` (griddepcontrol.wait: the previous grid has
completed and its stores are visible) before reading anything else and before
storing anything. Every program calls `wait` on every path, before any early
return: a kernel that ended without waiting could let the next one run ahead
of the one before it.

The kernels never signal their dependents early (griddepcontrol.launch_dependents):
on the H200 that made a b1 step slower, where the wait alone made it faster
(bench/README.md, session 5: graph replay 0.735 ms plain, 0.712 wait only,
0.722 and 0.826 with the early signal).

`enabled(device)` decides once per device: CUDA compute capability 9.0 or
newer, not the Triton interpreter, and `RADIANCED_PDL` not "0" (the A/B switch
of the benchmarks). Each Triton kernel on the decode path takes a
`PDL: tl.constexpr` and its launch passes `**launch(device)`.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # a Triton without grid dependency control: never enabled
    gdc_wait = None


@functools.cache
def _enabled(device: torch.device) -> bool:
    if device.type != "cuda" or gdc_wait is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("RADIANCED_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether Triton kernels on `device` launch with programmatic dependent launch."""
    return _enabled(torch.device(device.type, device.index if device.index is not None
                                 else (torch.cuda.current_device() if device.type == "cuda" else None)))


def launch(device: torch.device) -> dict:
    """The launch keywords for a kernel taking `PDL: tl.constexpr`: `PDL` and Triton's `launch_pdl`."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has completed (a no-op without PDL)."""
    if PDL:
        gdc_wait()


__all__ = ["enabled", "launch", "wait"]
