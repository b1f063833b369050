"""What the HTTP work costs the engine's process: CPU a request and a token, by thread, with and without
the HTTP front process (server/front_process.py says why it exists), on the tiny llama (no GPU).

    python tools/bench_front.py --out DIR [--before TREE] [--rounds 3] [--name N]

The daemon runs as users run it (a child process, served over HTTP, streamed). Every thread of the
daemon's process but the step thread shares the GIL with it, so their CPU is what can hold a step's
launch back (on the H200 a burst of 8 long prompts held one 8-13 ms: bench/README, session 26):

- a request: bursts of 8 streamed completions of 10 and of 2,000 prompt ids, 1 output token; the
  daemon's event loop's (its main thread's) CPU a request, its other threads' but the step thread's,
  and the front process's;
- a token: 8 concurrent streamed completions of 300 tokens; the same per generated token, and the
  aggregate tok/s;
- a burst under streams (issue 18's, small): 4 streams of 400 tokens, and 0.3 s in, 8 prompts of 2,000 ids
  from another process; the streams' gaps while it is served (p99) against their median over the run, and
  what a step's launch waited on average (radiance_step_launch_wait_seconds: wall time its thread did not
  run: the GIL, or a core). On this CPU the burst's prefill is compute that the streams wait for whatever
  the process layout, so the gaps say less than the launch wait.

`--before TREE` runs a checkout of another commit the same way, in the same run, rounds alternating
(PYTHONPATH=TREE: `git worktree add TREE be70e3b` is the last commit with HTTP in the daemon's
process). torch runs one thread (RADIANCED_CPU_THREADS=1): on 2 cores the other is left to the HTTP
work and the client, as in the tests. Per-thread CPU is read from /proc/PID/task/TID/schedstat.
Writes DIR/NAME.json (default bench_front.json) and prints a table of the medians over `--rounds`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radianced.bench.client import stream_request  # noqa: E402
from radianced.bench.daemon_process import ChildDaemon  # noqa: E402
from radianced.bench.scrape import Snapshot  # noqa: E402
from radianced.model.convert import convert  # noqa: E402
from radianced.model.tiny import make_tiny  # noqa: E402

FLAGS = ["--max-model-len", "4096", "--max-num-seqs", "8", "--card-mib", "4096"]
BURST, STREAMS, STREAM_TOKENS = 8, 8, 300


def cpu_by_thread(pid: int) -> dict[int, float]:
    """Seconds of CPU of each thread of `pid` so far, by thread id."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError):
            continue
    return out


class Sample:
    """CPU of the daemon's threads and of its front process over a span."""

    def __init__(self, d: ChildDaemon):
        self.pid = d.proc.pid
        fronts = [p.pid for p in psutil.Process(self.pid).children()
                  if "radianced.server.front" in " ".join(p.cmdline())]
        self.front = fronts[0] if fronts else None
        self.before = self._read()

    def _read(self) -> tuple[dict[int, float], float]:
        front = sum(cpu_by_thread(self.front).values()) if self.front is not None else 0.0
        return cpu_by_thread(self.pid), front

    def spent(self, per: int) -> dict[str, float]:
        """Milliseconds of CPU per `per` (requests or tokens): the event loop, the other threads but the
        step thread (the busiest), the step thread, the front process."""
        (threads0, front0), (threads1, front1) = self.before, self._read()
        delta = {tid: threads1[tid] - threads0.get(tid, 0.0) for tid in threads1}
        loop = delta.pop(self.pid)
        step = max(delta, key=delta.get)
        ms = 1e3 / per
        return {"loop_ms": loop * ms, "other_ms": (sum(delta.values()) - delta[step]) * ms, "step_ms": delta[step] * ms,
                "front_ms": (front1 - front0) * ms}


async def _requests(url: str, n: int, length: int, max_tokens: int, vocab: int, distinct: bool) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        name = (await http.get("/v1/models")).json()["data"][0]["id"]

        async def one(i: int) -> None:
            prompt = [random.randrange(vocab) for _ in range(length)] if distinct else [5 + i, 17, 2, 99]
            body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200, r.status_code
                async for _ in r.aiter_bytes():
                    pass

        await asyncio.gather(*(one(i) for i in range(n)))


def _burst_elsewhere(url: str, vocab: int) -> tuple[float, float]:
    """Issue 18's burst from another process (other users' clients): 8 prompts of 2,000 ids, 1 token each;
    (its start, its end) on the machine's monotonic clock."""
    t0 = time.perf_counter()
    asyncio.run(_requests(url, BURST, 2000, 1, vocab, True))
    return t0, time.perf_counter()


def _launch_wait(url: str) -> tuple[float, float]:
    """(sum, count) of radiance_step_launch_wait_seconds: a launch's wall time its thread did not run."""
    snap = Snapshot.parse(httpx.get(f"{url}/metrics").text)
    return (snap.values.get(("radiance_step_launch_wait_seconds_sum", ()), 0.0),
            snap.values.get(("radiance_step_launch_wait_seconds_count", ()), 0.0))


def burst_under_streams(url: str, vocab: int, pool: ProcessPoolExecutor) -> dict:
    """4 streams of 400 tokens; 0.3 s in, the burst arrives from another process. The streams' gaps while
    it is served against their median over the run, and the launches' mean wait for the GIL and the CPU."""
    async def run() -> tuple[list, tuple[float, float]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            name = (await http.get("/v1/models")).json()["data"][0]["id"]
            bodies = [{"model": name, "prompt": [5 + i, 17, 2, 99], "max_tokens": 400, "stream": True, "logprobs": 0,
                       "ignore_eos": True} for i in range(4)]
            streams = [asyncio.create_task(stream_request(http, "/v1/completions", b)) for b in bodies]
            await asyncio.sleep(0.3)
            window = await asyncio.get_running_loop().run_in_executor(pool, _burst_elsewhere, url, vocab)
            return await asyncio.gather(*streams), window

    before = _launch_wait(url)
    samples, (t0, t1) = asyncio.run(run())
    after = _launch_wait(url)
    gaps, during = [], []
    for smp in samples:
        t = smp.sent_at + (smp.ttft_s or 0.0)
        for gap in smp.itl_s:
            t += gap
            gaps.append(gap)
            if t0 <= t <= t1:
                during.append(gap)
    median = statistics.median(gaps)
    p99 = sorted(during)[max(0, int(0.99 * len(during)) - 1)] if during else float("nan")
    launches = after[1] - before[1]
    return {"itl_median_ms": median * 1e3, "itl_p99_burst_ms": p99 * 1e3, "p99_over_median": p99 / median,
            "burst_ms": (t1 - t0) * 1e3, "launches": launches,
            "launch_wait_mean_us": (after[0] - before[0]) / max(1, launches) * 1e6}


def measure(model: Path, tree: str | None, vocab: int, pool: ProcessPoolExecutor) -> dict:
    """One round against one daemon (of `tree`, or this checkout)."""
    env = os.environ.copy()
    os.environ.update(RADIANCED_CPU_THREADS="1", OMP_NUM_THREADS="1")  # the other core: the HTTP work's, the client's
    if tree is not None:
        os.environ["PYTHONPATH"] = tree
    try:
        d = ChildDaemon.start(["--model", str(model), *FLAGS])
    finally:
        os.environ.clear()
        os.environ.update(env)
    try:
        row = {}
        for length, bursts in ((10, 10), (2000, 4)):
            asyncio.run(_requests(d.url, BURST, length, 1, vocab, True))  # this length's first burst: not counted
            sample, t0 = Sample(d), time.perf_counter()
            for _ in range(bursts):
                asyncio.run(_requests(d.url, BURST, length, 1, vocab, True))
            row[f"request_{length}"] = {**sample.spent(BURST * bursts),
                                        "burst_ms": (time.perf_counter() - t0) / bursts * 1e3}
        asyncio.run(_requests(d.url, STREAMS, 4, STREAM_TOKENS, vocab, False))
        sample, t0 = Sample(d), time.perf_counter()
        asyncio.run(_requests(d.url, STREAMS, 4, STREAM_TOKENS, vocab, False))
        wall = time.perf_counter() - t0
        row["token"] = {**{k: v * 1e3 for k, v in sample.spent(STREAMS * STREAM_TOKENS).items()},  # microseconds
                        "tok_s": STREAMS * STREAM_TOKENS / wall}
        row["front_process"] = sample.front is not None
        burst_under_streams(d.url, vocab, pool)  # the first: not counted
        row["burst"] = burst_under_streams(d.url, vocab, pool)
        return row
    finally:
        d.stop()


def medians(rows: list[dict]) -> dict:
    return {part: {k: statistics.median(r[part][k] for r in rows) for k in rows[0][part]}
            for part in rows[0] if isinstance(rows[0][part], dict)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--before", help="a checkout of another commit, run the same way for comparison")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="bench_front")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = make_tiny("llama", Path(tmp))
        convert(src, src / "model.rad")
        vocab = 256
        trees = {"this": None, **({"before": a.before} if a.before else {})}
        rows: dict[str, list[dict]] = {k: [] for k in trees}
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            for _ in range(a.rounds):
                for key, tree in trees.items():
                    rows[key].append(measure(src / "model.rad", tree, vocab, pool))
    result = {"rounds": rows, "median": {k: medians(v) for k, v in rows.items()}, "trees": trees,
              "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{a.name}.json").write_text(json.dumps(result, indent=1))
    print(f"{'':8s} {'part':13s} {'loop':>8s} {'other':>8s} {'step':>8s} {'front':>8s}  (ms a request, us a token)")
    for key, m in result["median"].items():
        for part, v in m.items():
            if part == "burst":
                print(f"{key:8s} {part:13s} streams' ITL median {v['itl_median_ms']:.2f} ms, p99 during the burst "
                      f"{v['itl_p99_burst_ms']:.2f} ms ({v['p99_over_median']:.1f}x); a launch waited "
                      f"{v['launch_wait_mean_us']:.0f} us on average")
                continue
            extra = f"  {v['tok_s']:.0f} tok/s" if "tok_s" in v else f"  {v['burst_ms']:.0f} ms a burst"
            print(f"{key:8s} {part:13s} {v['loop_ms']:8.3f} {v['other_ms']:8.3f} {v['step_ms']:8.3f} "
                  f"{v['front_ms']:8.3f}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
