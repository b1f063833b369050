"""Python's garbage collector's pauses, timed: `radiance_gc_pause_seconds{generation}`.

A collection stops the whole interpreter: the event loop and the thread that launches the
steps. The daemon freezes its start-up heap out of the collector before ready, so what is
left is the serving heap's collections; a full one over many live requests' objects can take
tens of milliseconds, which lands on whichever token is being served. This histogram says
whether such pauses happen while serving, how often and how long (gc.callbacks: the
interpreter calls it on the collecting thread at each collection's start and stop).
"""

from __future__ import annotations

import gc
import time

from prometheus_client import CollectorRegistry, Histogram

# A young collection takes microseconds; a full one over a large heap, tens of milliseconds.
GC_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32)


class GcPauses:
    """Times every collection of this interpreter into a histogram of `registry`, until `close`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._pauses = Histogram("radiance_gc_pause_seconds", "Python garbage collections in the daemon's process "
                                 "(the interpreter, the step thread's launches included, stops meanwhile; the HTTP "
                                 "front's are not counted), by generation collected.", ["generation"],
                                 buckets=GC_BUCKETS, registry=registry)
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started:
            self._pauses.labels(generation=str(info["generation"])).observe(time.perf_counter() - self._started)
            self._started = 0.0

    def close(self) -> None:
        """Stop timing (a test's daemon in the test's process leaves no callback behind)."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
