"""A timeline of the driver's rounds, for finding where a stall lives: `RADIANCED_STEP_TRACE=FILE`.

The metrics say that a step took long (issue 18: a decode step of 10 ms while a burst of prompts
arrives, against 1.6 ms typical); a histogram cannot say what that round did. With the variable
set, the daemon appends one JSON line per event to FILE (line-buffered writes under a lock; the
times are `time.perf_counter()`, CLOCK_MONOTONIC on Linux, so a client on the same machine can cut
out a window of its own): on the step thread a line per round (`round`), on the event loop a line
per request's HTTP arrival (`http`: from its handler's start, reading the body, then preparing it on a
worker thread), per request submitted (`submit`) and per step's events dispatched to the streams
(`dispatch`).
Unset, `StepTrace.off()` records nothing and costs a call a round.

    {"k": "round", "t": start, "inbox": entries taken, "plan_s": planning, "launch": [seqs, decodes,
     tokens] or null, "launch_s": wall, "launch_cpu_s": the thread's CPU in it, "collect": [seqs,
     decodes, tokens] or null, "own_s": the collected step's device time, "end": the round's end,
     "runq_s": the step thread's time runnable but not running since the previous round's row (the kernel's
     schedstat: a thread off the CPU for want of a core, not waiting for the GIL or the device; null in the
     first round and where unreadable), "proc_cpu_s": the whole process's CPU time in that span (every
     thread: one thread's worth of the wall time is the GIL serialising the others; more is code running
     without it)}
    {"k": "http", "t": the handler's start, "id": request id, "body_s": reading the body, "prepare_s": the
     prepare thread's decoding and tokenizing, from the hand-off to the result}
    {"k": "submit", "t": when, "id": request id, "prompt": tokens}
    {"k": "dispatch", "t": when the loop ran it, "posted": when the step thread posted it, "events": n}
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time

ENV = "RADIANCED_STEP_TRACE"

log = logging.getLogger(__name__)


class StepTrace:
    def __init__(self, path: str | None):
        self._file = open(path, "a", buffering=1) if path else None  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()
        self._last: tuple[float | None, float] | None = None  # (runq, process CPU) at the previous round's row

    @classmethod
    def from_env(cls) -> StepTrace:
        """The trace $RADIANCED_STEP_TRACE names (off where unset). Raises OSError where it cannot be opened."""
        return cls(os.environ.get(ENV) or None)

    @classmethod
    def off(cls) -> StepTrace:
        return cls(None)

    @property
    def on(self) -> bool:
        return self._file is not None

    def round(self, t: float, inbox: int, plan_s: float, work, done, end: float) -> None:
        """A round of `AsyncEngine._rounds`: `work` (engine.Work) planned, `done` (engine.Executed) its result."""
        if self._file is None:
            return
        launched = work.launch
        finished = done.finished
        prev, now = self._last, (_runq(), time.process_time())
        self._last = now
        self._write({"k": "round", "t": t, "inbox": inbox, "plan_s": plan_s, "launch": _shape(launched),
                     "launch_s": done.launch_s, "launch_cpu_s": done.launch_cpu_s,
                     "collect": _shape(finished.plan if finished is not None else None),
                     "own_s": done.output.seconds if done.output is not None else None, "end": end,
                     "runq_s": None if prev is None or None in (prev[0], now[0]) else now[0] - prev[0],
                     "proc_cpu_s": None if prev is None else now[1] - prev[1]})

    def http(self, t: float, request_id: str, body_s: float, prepare_s: float) -> None:
        if self._file is not None:
            self._write({"k": "http", "t": t, "id": request_id, "body_s": body_s, "prepare_s": prepare_s})

    def submit(self, t: float, request_id: str, prompt: int) -> None:
        if self._file is not None:
            self._write({"k": "submit", "t": t, "id": request_id, "prompt": prompt})

    def dispatch(self, t: float, posted: float, events: int) -> None:
        if self._file is not None:
            self._write({"k": "dispatch", "t": t, "posted": posted, "events": events})

    def close(self) -> None:
        if self._file is not None:
            with self._lock:
                self._file.close()
                self._file = None

    def _write(self, row: dict) -> None:
        """One line; a write that fails (a full disk) turns the trace off, said once: the trace is a
        diagnosis, and it must not fail a step or a request."""
        line = json.dumps(row, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is None:
                return
            try:
                self._file.write(line)
            except OSError as e:
                log.warning("%s: the step trace stopped: %s", ENV, e)
                failed, self._file = self._file, None
                with contextlib.suppress(OSError):  # its buffer cannot be written either
                    failed.close()


def _runq() -> float | None:
    """The calling thread's seconds runnable but waiting for a CPU so far (/proc/thread-self/schedstat's
    second field, ns), or None where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def _shape(plan) -> list[int] | None:
    """[sequences, decodes, tokens] of a StepPlan, or None."""
    return None if plan is None else [len(plan.seqs), plan.decodes, plan.num_tokens]
