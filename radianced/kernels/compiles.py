"""Kernel variants built in this process, counted where they are built.

A Triton kernel compiles (or loads from the disk cache) once per variant: per
set of constexpr values, integer-argument specializations (== 1, divisible by
16) and dtypes. A variant first met on the request path costs a compile of
0.1-1 s inside a user's TTFT. Start-up warms every variant the daemon can meet
(engine/warmup.py); this module proves it did, from Triton's own hooks rather
than a counter of ours that a new kernel could slip past:

- `knobs.runtime.jit_post_compile_hook` runs after every in-process cache miss
  of a `@triton.jit` function (ours and fla-core's alike), whether the binary
  came from the compiler or from the disk cache;
- an autotuner (fla-core's `triton.autotune`) that meets a new key benchmarks
  every config: `Autotuner.run` is wrapped to count the keys it tuned.

`CompileLog.install()` is idempotent and process-wide (Triton's hook is one
global); `phase` names what the process is doing ("start-up", "serving"), and
each build is counted under the phase it happened in. On the CPU backend no
Triton kernel ever runs, so the counts stay 0 there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Build:
    """One kernel variant built: which kernel, what kind of build, when, under which phase."""

    kernel: str  # the function's qualified name
    kind: str  # "compile" (a Triton variant) or "autotune" (an autotuner's new key)
    phase: str
    detail: str  # constexprs and specializations (compile) or the tuning key (autotune)
    at: float  # time.monotonic()


class CompileLog:
    """The process's kernel builds, by phase (module docstring)."""

    _installed: CompileLog | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.phase = "start-up"
        self.builds: list[Build] = []
        self.listeners: list = []  # callables(Build), e.g. the metrics' counter

    @classmethod
    def install(cls) -> CompileLog:
        """The process's log, its hooks installed on first call. Needs triton (CUDA backend)."""
        with cls._lock:
            if cls._installed is None:
                cls._installed = cls()
                cls._installed._hook()
            return cls._installed

    def count(self, phase: str | None = None) -> int:
        return sum(1 for b in self.builds if phase is None or b.phase == phase)

    def by_kernel(self, phase: str | None = None) -> Counter:
        return Counter(b.kernel for b in self.builds if phase is None or b.phase == phase)

    def _record(self, kernel: str, kind: str, detail: str) -> None:
        build = Build(kernel, kind, self.phase, detail, time.monotonic())
        self.builds.append(build)
        if self.phase != "start-up":
            log.warning("kernel %s %s while %s: %s", kind, kernel, self.phase, detail[:400])
        for listener in self.listeners:
            listener(build)

    def _hook(self) -> None:
        import triton
        from triton.runtime.autotuner import Autotuner

        previous = triton.knobs.runtime.jit_post_compile_hook

        def compiled(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
            self._record(fn.name, "compile", f"{compile.get('constants')} {key}")
            if previous is not None:
                return previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                                already_compiled=already_compiled)
            return None

        triton.knobs.runtime.jit_post_compile_hook = compiled
        run = Autotuner.run

        def tuned_run(tuner, *args, **kwargs):
            known = len(tuner.cache)
            result = run(tuner, *args, **kwargs)
            if len(tuner.cache) > known:
                name = getattr(tuner, "base_fn", tuner.fn)
                self._record(getattr(name, "__name__", str(name)), "autotune", str(list(tuner.cache)[-1]))
            return result

        Autotuner.run = tuned_run
