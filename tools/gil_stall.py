"""How long a step thread waits for the GIL while another thread runs Python, by switch interval (no GPU).

    python tools/gil_stall.py [--launches 10] [--device-ms 2] [--busy-ms 20] [--steps 400]

A stand-in for the daemon's two threads on a CUDA card. The step thread's step: `--launches` calls
that each release and take back the GIL (torch's bindings release it around every op; `time.sleep(0)`
here), a wait for the device that releases it (an event synchronize: sleeping out `--device-ms`), then
a quarter as many calls for the outputs. The other thread, the event loop, runs pure Python for
`--busy-ms` every 50 ms (a burst of HTTP requests arriving), holding the GIL until Python's switch
interval makes it let go. Prints the step's wall p50 / p99 / max for the default interval (5 ms) and
shorter ones, with the loop idle and busy: a step that needs the GIL back N times while the loop is
busy can wait up to N intervals.

On this repository's 2-core CPU (session 19): 10 launches, loop busy 20 ms every 50: p99 20.2 ms at
5 ms, 14.1 at 1 ms, 6.2 at 0.2 ms (2.6 with the loop idle). On the H200 the daemon's decode steps
during a prefill burst reached 5-20 ms of device time against 1.7-2.0 (bench/README, session 19);
`tools/bench_served.py --switch-interval-ms` measures the daemon itself: on the H200 at 0.5 ms the burst's
stall stayed (session 20), so the daemon keeps Python's interval.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time


def run(interval_s: float, launches: int, device_s: float, busy_s: float, steps: int) -> tuple[float, float, float]:
    """(p50, p99, max) of the step's wall in ms with the switch interval `interval_s`."""
    sys.setswitchinterval(interval_s)
    walls: list[float] = []
    done = threading.Event()

    def step_thread() -> None:
        for _ in range(steps):
            t0 = time.perf_counter()
            for _ in range(launches):
                time.sleep(0)
            rest = device_s - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)
            for _ in range(launches // 4):
                time.sleep(0)
            walls.append(time.perf_counter() - t0)
        done.set()

    def event_loop() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < busy_s:
                pass
            time.sleep(0.05)

    threads = [threading.Thread(target=step_thread), threading.Thread(target=event_loop)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    walls.sort()
    return statistics.median(walls) * 1e3, walls[int(0.99 * len(walls))] * 1e3, walls[-1] * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=10)
    ap.add_argument("--device-ms", type=float, default=2.0)
    ap.add_argument("--busy-ms", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    default = sys.getswitchinterval()
    for busy in (0.0, args.busy_ms):
        for interval in (default, 0.001, 0.0002):
            p50, p99, top = run(interval, args.launches, args.device_ms / 1e3, busy / 1e3, args.steps)
            print(f"loop busy {busy:4.0f} ms every 50, switch interval {interval * 1e3:3.1f} ms: "
                  f"step p50 {p50:5.2f} p99 {p99:5.2f} max {top:5.2f} ms", flush=True)
    sys.setswitchinterval(default)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
