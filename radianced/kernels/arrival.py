"""The last program of a group to arrive: one launch that also does its group's reduction.

A reduction over the programs of a launch (the b1 MoE's sum over its k
experts, kernels/moe.py) needs every program's stores done first, which is
what a second launch gives. Instead each program stores its part, then counts
itself in with an atomic; the program that counts last does the reduction,
reading the others' parts, and puts the counter back to zero for the next
launch. The kernel stays graph-capturable (no host sync, no memset) and
deterministic (the reduction's order is fixed, whoever arrives last).

It pays only where the reduction is short: the last program's work is a
serial tail after everyone else's. The attention splits' merge and the
router's top-k done this way were no faster than their second launch on the
H200 (bench/README.md, session 5) and stay separate launches.

Counters live in one zeroed int32 buffer per device (`counters`), shared by
every kernel on the compute stream: a launch leaves the counters it used at
zero when it ends, and kernels on one stream do not overlap (under
programmatic dependent launch the next kernel counts only after its grid
wait, kernels/pdl.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_buffers: dict[torch.device, torch.Tensor] = {}
_outgrown: list[torch.Tensor] = []  # kept alive: a captured CUDA graph may still use their addresses


def counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed int32 counters on `device`, the same buffer on every call while it is
    big enough. Growing it inside a CUDA graph capture is refused: the first launch at a shape
    must run before capture (every graph runner warms up first)."""
    buf = _buffers.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"kernels/arrival.py: {n} counters are needed on {device} during a CUDA graph "
                               "capture, more than were allocated; run the same launch once before capturing")
        if buf is not None:
            _outgrown.append(buf)
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _buffers[device] = buf
    return buf


@triton.jit
def last_arrival(counter_ptr, expected):
    """True in the program that is the `expected`-th to arrive at `counter_ptr` (zero at rest),
    which then resets it to zero. Every arriving program's stores made before the call are
    visible to the last one's loads after it: a barrier orders the program's own threads, then
    an acquire-release atomic at GPU scope. Read the others' parts with `cache_modifier=".cg"`
    (from L2, never a stale L1 line)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == expected - 1
    tl.store(counter_ptr, 0, mask=last)
    return last


__all__ = ["counters", "last_arrival"]
