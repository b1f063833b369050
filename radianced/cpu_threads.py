"""torch's CPU threads in the daemon: how many, why OpenMP's idle threads spin only briefly, and why the daemon
drops OpenMP's thread-binding variables.

`prepare_openmp` (daemon.py calls it before torch loads libgomp, which reads it once) sets GOMP_SPINCOUNT=20000
(unless OMP_WAIT_POLICY or it is set). libgomp also spins far less (its throttled count) while more of its threads exist
than cores: each thread that ran a parallel region keeps a team, so a second one (a loader thread beside
the step thread) made every region pay a wake-up on 2 cores (SmolLM2's q4_1 product 86 us against 41,
bench/README session 25); the daemon's served steps run on the one step thread once the loader has ended.
"""

from __future__ import annotations

import os


def count() -> int:
    """torch's CPU threads: $RADIANCED_CPU_THREADS, else every core this process may use.

    The event loop and the step worker keep their turn because OpenMP's idle threads spin only
    briefly before they sleep (GOMP_SPINCOUNT=20000, daemon.py, before torch loads). Measured
    on this 2-core machine (shared with other jobs: each row's transformers figure is from the
    same run), SmolLM2-135M fp32 through HTTP, tools/bench_cpu.py, 128 tokens a request
    (bench/results/2026-12-02-cpu-18e622f-cpu.md unless said):
        1 thread:                      b1 12.3 tok/s, c=8 45.4 tok/s, /health worst  7.1 ms
        2 threads, spin 20,000:        b1 19.7 tok/s, c=8 79.2 tok/s, /health worst 10.0 ms
        2 threads, OMP_WAIT_POLICY=PASSIVE (sleep at once): b1 13.7, c=8 61.1 tok/s, 9.3 ms (at 2748a69)
        2 threads, OMP_WAIT_POLICY=ACTIVE (spin forever):   b1 0.5, c=8 3.4 tok/s (64 tokens)
    (/health: the worst answer during a 1,500-token prefill.) OpenMP's default, 300,000 rounds,
    had given 1.0 tok/s with 2 threads against 6.9 with 1: spinning threads crowd out the
    Python threads. With the other core busy (load average 2-3, PASSIVE) two threads still
    gave c=8 43.7 against 39.3 tok/s, and b1 12.2 against 13.8."""
    given = os.environ.get("RADIANCED_CPU_THREADS")
    if given:
        return max(1, int(given))
    return len(os.sched_getaffinity(0))


BINDING = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY")  # OpenMP's thread binding, read as libgomp loads


def prepare_openmp() -> dict[str, str]:
    """The daemon's OpenMP environment, set before torch loads libgomp (which reads it once): an idle OpenMP thread
    spins 20,000 rounds (tens of microseconds) before it sleeps, not 300,000, so torch's threads leave the event
    loop and the step worker their turn (`count` has the numbers), unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is
    set; and no OpenMP binding (`drop_binding`, whose removed variables it returns)."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "20000")
    return drop_binding()


def drop_binding(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Remove OpenMP's thread-binding variables from `environ` (default os.environ) before torch loads libgomp,
    and return those removed (OMP_PROC_BIND=false binds nothing and stays).

    Where one is set, libgomp binds the process's first thread to one CPU as it loads, and every thread started
    after it inherits that CPU: the step thread, the OpenMP team it starts and the HTTP front's process. Measured
    on the 2-core CPU with OMP_PROC_BIND=true (SmolLM2, RADIANCED_CPU_THREADS=2): every thread of the daemon and
    of its front allowed CPU 0 alone, the daemon at 96% of one core, c = 8 176.5 tok/s against 323.5 without. The
    daemon picks its threads itself (`count`); the OS places them."""
    environ = os.environ if environ is None else environ
    return {k: environ.pop(k) for k in BINDING
            if k in environ and not (k == "OMP_PROC_BIND" and environ[k].strip().lower() == "false")}
