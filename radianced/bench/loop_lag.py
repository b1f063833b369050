"""How late the benchmark client's own event loop ran while a workload was measured.

One asyncio loop sends every request and reads every stream (client.py). When a
burst keeps that loop busy, tokens wait in the socket until it reads them, and the
row's TTFT and ITL then time the client, not the daemon. Seen on the 2-core CPU:
136 requests sent at once (the overload row at --max-queue 128) kept the client's
loop about 80% busy for 2 s (httpx's own per-request work) while the daemon idled;
the first 8 streams' tokens arrived in bursts (ITL p50 0.1 ms) and the streams took
2-3 s where the daemon's log says it generated them in 0.11 s.

`LoopLag` is a ticker on that loop: it asks to wake every `INTERVAL_S` and records
how late it woke (the time the loop spent on other callbacks first). A row reports
the distribution, and the Markdown table marks the row's latencies where the lag's
p99 reaches the row's ITL p50 (`client_bound`): those latencies are the client's.
"""

from __future__ import annotations

import asyncio
import time

from radianced.bench.stats import Distribution

INTERVAL_S = 0.005


class LoopLag:
    """The running loop's wake-up lag between `start` and `stop`."""

    def __init__(self, interval_s: float = INTERVAL_S):
        self.interval_s = interval_s
        self._lags: list[float] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._tick())

    async def stop(self) -> Distribution:
        """Stop ticking; the lags recorded (seconds each wake-up came after it was due)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        return Distribution.of(self._lags)

    async def _tick(self) -> None:
        while True:
            due = time.perf_counter() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self._lags.append(max(0.0, time.perf_counter() - due))


def client_bound(lag: Distribution | None, itl: Distribution) -> bool:
    """Whether a row's latencies time the client: its loop's lag p99 reached the row's ITL p50."""
    return lag is not None and lag.p99 is not None and itl.p50 is not None and lag.p99 >= itl.p50
