"""A step's own time on its device, for the pacer (engine/pacing.py).

The driver's rounds overlap: step k+1 is launched before step k is collected, so the wall
time between two collects is neither step's. Measured that way on the CPU, where a launch
computes the step, each time was the next step's: a 24-token step beside decodes read 176 ms
and a 2,048-token one 7.5 ms, and the pacer's budget swung between the two every step
(issue 18). So each step carries its own timer: on the CPU the launch call itself; on CUDA an
event pair recorded around the launch's device work, whose interval starts when the device
reaches the step (after the one before it) and ends with its last kernel.
"""

from __future__ import annotations

import time

import torch


class StepTimer:
    """Started at a step's launch, stopped at its end; `seconds()` once the device has run it."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start, self._end = time.perf_counter(), None

    def stop(self) -> None:
        """The step's last device work is queued."""
        if self._cuda:
            self._end.record()
        else:
            self._end = time.perf_counter()

    def seconds(self) -> float | None:
        """The step's time, or None where the device has not finished it yet (a CUDA step that
        samples nothing is collected without waiting for it: asking would add a sync)."""
        if not self._cuda:
            return self._end - self._start
        return self._start.elapsed_time(self._end) / 1e3 if self._end.query() else None
