"""The step thread's turn at the GIL ahead of the HTTP threads' (issue 18).

On a GPU a step's launch is Python work that only queues kernels: the device runs
out of work if the launch is slowed. When a burst of requests arrives, the event
loop and the prepare threads run Python for each one (uvicorn's h11, starlette,
our handlers: ~1.6 ms of CPU a 2,000-token request on the H200's host), and
CPython hands the GIL out with no priority: a thread waiting for it asks the
holder to drop it only after a switch interval with no switch in between, so
while the other threads pass the GIL among themselves the step thread may never
ask. Measured on the H200 (bench/results/2026-12-04-h200-ae3a804-served-burst):
a decode launch of 1.0 ms of CPU took 7.8-12.7 ms of wall time while 8 requests
arrived, the step thread never short of a core (schedstat) and the process
running one core's worth of work throughout; the running streams' tokens waited
that long. A 0.05 ms switch interval changed nothing.

So the step thread says when it works in Python (`busy`, the round's planning,
launch and bookkeeping) and when it waits for the device (`device_wait`, the
collected step's event) or for work (`idle`), and the HTTP threads give way at
the points they pass for every request, chunk and step's events (`give_way`):
while the step thread is busy they wait, the GIL released, until it is not, for
at most `WAIT_S`. Their work then runs while the device computes. Off on the
CPU, where the step is the compute and the step thread is always busy: giving
way there would only stall the HTTP side.
"""

from __future__ import annotations

import contextlib
import threading

WAIT_S = 0.002  # the longest one give_way waits: a decode launch is ~1 ms of CPU on the H200


class StepGate:
    def __init__(self, enabled: bool = False, wait_s: float = WAIT_S):
        self.enabled = enabled  # set once the device is known (daemon.py): on CUDA
        self.wait_s = wait_s
        self._idle = threading.Event()
        self._idle.set()

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def work(self) -> None:
        """The step thread: its Python work begins (a round)."""
        self._idle.clear()

    def rest(self) -> None:
        """The step thread: it waits (for work, or the device) and needs the GIL no more."""
        self._idle.set()

    @contextlib.contextmanager
    def device_wait(self):
        """The step thread, around a wait for the device: the others' turn."""
        self.rest()
        try:
            yield
        finally:
            self.work()

    def give_way(self) -> bool:
        """Another thread, before Python work: wait while the step thread works, at most `wait_s` (the
        GIL released meanwhile). True if it waited."""
        if not self.enabled or self._idle.is_set():
            return False
        self._idle.wait(self.wait_s)
        return True
