"""Programmatic dependent launch (Hopper): a kernel starts while the one before it finishes.

A b1 decode step is ~110 short kernels, and between two of them in a CUDA graph
the device idles about a microsecond (the next grid's launch, its first loads
in flight). Launched with `launch_pdl=True`, a kernel's programs may start as
soon as every program of the previous kernel has signalled
(`launch_dependents`); they may read what no earlier kernel of the step writes
(weights) at once, and must `wait` (griddepcontrol.wait: the previous grid has
completed and its stores are visible) before reading anything else and before
storing anything. Every program calls `wait` on every path, before any early
return: a kernel that ended without waiting could let the next one run ahead
of the one before it.

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
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: never enabled
    gdc_launch_dependents = gdc_wait = None


@functools.cache
def _level(device: torch.device) -> int:
    if device.type != "cuda" or gdc_wait is None or os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    if torch.cuda.get_device_capability(device)[0] < 9:
        return 0
    return int(os.environ.get("RADIANCED_PDL", "1"))


def level(device: torch.device) -> int:
    """0: plain launches; 1: PDL, each kernel waiting on the previous one's end (its launch
    overlaps that kernel's last programs); 2: also each kernel signalling its dependents as soon
    as its programs have passed their wait."""
    return _level(torch.device(device.type, device.index if device.index is not None
                               else (torch.cuda.current_device() if device.type == "cuda" else None)))


def launch(device: torch.device) -> dict:
    """The launch keywords for a kernel taking `PDL: tl.constexpr`: `PDL` and Triton's `launch_pdl`."""
    lv = level(device)
    return {"PDL": lv, "launch_pdl": lv > 0}


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has completed (a no-op without PDL)."""
    if PDL > 0:
        gdc_wait()


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the next kernel's programs start once every program here has called this (level 2)."""
    if PDL > 1:
        gdc_launch_dependents()


__all__ = ["launch", "launch_dependents", "level", "wait"]
