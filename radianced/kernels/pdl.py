"""Programmatic dependent launch (Hopper): a kernel's launch overlaps the end of the one before it.

A b1 decode step is ~90 short kernels, and between two of them in a CUDA graph
the device idles: the next grid's launch, its first loads in flight. Launched
with `launch_pdl=True`, a kernel's programs may start before the previous
kernel has ended; they may read at once what no earlier kernel of the step
writes (weights: the gemv issues its weight loads first), and must `wait`
(griddepcontrol.wait: the previous grid has completed and its stores are
visible) before reading anything else and before storing anything. Every
program calls `wait` on every path, before any early return: a kernel that ended
without waiting could let the next one run ahead of the one before it.

When the next kernel may start is the previous kernel's signal
(griddepcontrol.launch_dependents): by default, once each of its programs has
exited. Levels 2 and 3 let a kernel whose whole grid fits on the device at once
(at most one program per SM, `launch(device, programs)`) signal early, so its
dependent's programs are resident, their weight loads in flight, while it runs;
a larger grid never does (the dependents would take the SMs its later programs
need). No grid waited on is ever short of SMs: a dependent launches only once
every program of the signalling grid is resident. On the H200 the early signal
paid before attention took RoPE and the experts took the route into their
launches (b1 graph replay 0.632 ms at level 3, 0.643 at 1), and costs since
(0.622 against 0.612): the default waits only (bench/README.md, session 6).

Levels (`RADIANCED_PDL`, the A/B switch of the benchmarks; decided once per
device, 0 without CUDA compute capability 9.0, under the Triton interpreter):

- 0: plain launches;
- 1 (default): PDL, every kernel waits, none signals early;
- 2: small grids signal right after their wait (the dependent starts while this
  kernel runs);
- 3: small grids signal before their wait (the dependent may start while the
  kernel before this one still runs: two launches ahead).

Each Triton kernel on the decode path takes a `PDL: tl.constexpr`, calls
`wait(PDL)` before its first dependent access, and its launch passes
`**launch(device, programs)`.
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

DEFAULT_LEVEL = 1
LEVELS = (0, 1, 2, 3)


@functools.cache
def _level(device: torch.device) -> int:
    raw = os.environ.get("RADIANCED_PDL", str(DEFAULT_LEVEL))
    if raw not in {str(lv) for lv in LEVELS}:
        raise ValueError(f"RADIANCED_PDL={raw!r}: use one of {', '.join(map(str, LEVELS))} "
                         f"(0 off, 1 wait only, 2 or 3 small grids signal early)")
    if device.type != "cuda" or gdc_wait is None or os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    if torch.cuda.get_device_capability(device)[0] < 9:
        return 0
    return int(raw)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA device (the programs that fit on it at once, one each); 1 elsewhere."""
    return _sm_count(_resolve(device))


def _resolve(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def level(device: torch.device) -> int:
    """The PDL level of `device` (module docstring); 0 where it is off."""
    return _level(_resolve(device))


def launch(device: torch.device, programs: int | None = None) -> dict:
    """The launch keywords for a kernel taking `PDL: tl.constexpr`: `PDL` (its level) and Triton's
    `launch_pdl`. `programs`: the grid's size; at levels 2 and 3 a grid of at most one program
    per SM signals its dependents early, a larger one (or None) never does."""
    device = _resolve(device)
    lv = _level(device)
    if lv > 1 and (programs is None or programs > _sm_count(device)):
        lv = 1
    return {"PDL": lv, "launch_pdl": lv > 0}


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has completed (a no-op without PDL); at
    levels 2 and 3 also signal this kernel's dependents (after, or before, the wait)."""
    if PDL == 3:
        gdc_launch_dependents()
    if PDL > 0:
        gdc_wait()
    if PDL == 2:
        gdc_launch_dependents()


__all__ = ["DEFAULT_LEVEL", "LEVELS", "launch", "level", "sm_count", "wait"]
