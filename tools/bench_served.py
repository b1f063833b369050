"""Issue 18's rows: what a user of the HTTP API sees from a daemon started as users start it.

    python tools/bench_served.py --out DIR [--layers 8] [--requests 200] [--bursts 25] [--env K=V] [--name N]
                                 [--switch-interval-ms MS] [--burst-repeats 5] [--one-start]
                                 [--parts ttft,sweep,prefill_burst,burst_gil] [-- FLAGS]

On a synthetic Qwen3-30B-A3B-shaped `.rad` (tools/make_synthetic.py, Zipf 1.0) the
daemon runs as a child process (`radianced.bench.daemon_process.ChildDaemon`), its
flags those after `--` (default: --placement resident --max-num-seqs 8); every
request goes over HTTP, streamed (`radianced.bench.client.stream_request`).

- start-up: seconds to ready with an empty kernel cache (a fresh TRITON_CACHE_DIR),
  then again on the same cache (a warm restart), and what the log says of warm-up;
- TTFT: `--requests` prompts of lengths uniform in 1..4,000 one at a time, each
  followed by its twin, the same tokens with the first moved up by one (`twin_of`: never a prefix
  hit; each pair's length and TTFTs are kept, with what /metrics' counters did during
  each: the CUDA allocator's cudaMalloc, cudaFree and retries, the garbage collector's
  collections and seconds, the engine's steps, their wall and their own device seconds); then `--bursts` bursts of 8 such
  prompts (lengths uniform in 1..500) and their twins. p50 / p99 / max of the first TTFTs, and of first / twin, the ratio a
  kernel build on the request path would raise (target: p99 at most 1.2). In a burst the first step takes the
  requests that reached the step thread before it planned (on the H200 one or two of the eight: ~13 ms, the rest a
  step later, 20-28 ms), so a request's ratio to its twin says how many arrived in time, not what it paid; the
  burst's last first token against its twin burst's (`burst_last_ratio`) is what a build on the request path
  raises and the arrival order barely moves. Each burst's lengths and TTFTs are kept;
- kernel builds while serving: /metrics' radiance_kernel_builds_total{phase=
  "serving"} before and after (target 0);
- c-sweep: 16 requests of 128 prompt and 128 output tokens at c = 1 and c = 8:
  aggregate generated tok/s (target: c = 8 at least 3x c = 1);
- prefill burst: 4 streams decoding 1,024 tokens; 0.3 s after they start, 8 prompts
  of 2,000 tokens arrive together from another process (other users' clients); the
  running streams' ITL p50 and p99 while the burst prefills, against their median over
  the whole run (target: p99 at most 3x p50); `--burst-repeats` times, each burst's ratio kept and all their
  gaps pooled (one burst's p99 is its third-largest gap), and the daemon's step trace (RADIANCED_STEP_TRACE,
  engine/step_trace.py) around each burst's longest gap: the rounds, arrivals and dispatches that made it,
  each round with the step thread's time runnable off a CPU and the process's CPU time, and the cgroup's CPU
  throttling over each burst; then once more with the GIL's holders sampled.

Writes DIR/NAME.json (default bench_served.json); prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radianced.bench.client import completion_body, stream_request  # noqa: E402
from radianced.bench.daemon_process import ChildDaemon  # noqa: E402
from radianced.bench.scrape import Snapshot  # noqa: E402
from radianced.bench.workloads import PROMPT_ID_RANGE, prompt_ids  # noqa: E402
from tools.gil_sample import GilSample  # noqa: E402
from tools.served_metrics import (ALLOCATOR, counter_totals, counters, histogram_deltas, pct,  # noqa: E402
                                  serving_builds, step_kinds, summary)
from tools.served_report import lines as served_lines  # noqa: E402

COMPLETIONS = "/v1/completions"


def prompt_source() -> Callable[[int], list[int]]:
    """n -> a fresh prompt of n token ids each call (the serving bench's `prompt_ids` under a counter):
    no prompt is a prefix-cache hit for another."""
    seeds = itertools.count()
    return lambda n: prompt_ids(n, f"served-{next(seeds)}")


async def timed_with_counters(http, prompt: list[int]):
    """One streamed request of one token, and what moved in `counters` meanwhile."""
    before = await counters(http)
    sample = await stream_request(http, COMPLETIONS, completion_body(prompt, 1))
    after = await counters(http)
    return sample, {k: after[k] - before[k] for k in after}


def twin_of(prompt: list[int]) -> list[int]:
    """A prompt's twin: the same tokens but the first, which moves up by one. The same length, nearly the same
    routing (a MoE step's cost follows where its tokens route: with fresh random tokens the H200's pairs came
    out up to 2x apart both ways, and with the tokens reversed the device's own time for one pair still
    differed by 60%, session 16), and no prefix-cache hit (a cached block is a run of 16 tokens from the
    start, so the first token changes every block's key)."""
    low, high = PROMPT_ID_RANGE
    return [low + (prompt[0] + 1 - low) % (high - low), *prompt[1:]]


async def ttft_rows(http, prompts: Callable[[int], list[int]], requests: int, bursts: int,
                    trace: Path | None = None) -> dict:
    """`worst_pair_trace`: the daemon's step trace while the pair with the largest first/twin ratio had its
    first request out (the `http` row says how long its body and its preparation took)."""
    rng = random.Random(1)
    one, one_ratio, pairs = [], [], []
    for _ in range(requests):
        n = rng.randint(1, 4000)
        prompt = prompts(n)
        first, first_alloc = await timed_with_counters(http, prompt)
        twin, twin_alloc = await timed_with_counters(http, twin_of(prompt))
        if first.ok and twin.ok:
            one.append(first.ttft_s)
            one_ratio.append(first.ttft_s / twin.ttft_s)
            pairs.append({"n": n, "first": first.ttft_s, "twin": twin.ttft_s, "first_counters": first_alloc,
                          "twin_counters": twin_alloc, "first_sent": first.sent_at})
    burst, burst_ratio, last_ratio, bursts_kept = [], [], [], []
    for _ in range(bursts):
        lengths = [rng.randint(1, 500) for _ in range(8)]
        batch = [prompts(n) for n in lengths]
        firsts = await asyncio.gather(*(stream_request(http, COMPLETIONS, completion_body(p, 1)) for p in batch))
        twins = await asyncio.gather(*(stream_request(http, COMPLETIONS, completion_body(twin_of(p), 1))
                                       for p in batch))
        for a, b in zip(firsts, twins):
            if a.ok and b.ok:
                burst.append(a.ttft_s)
                burst_ratio.append(a.ttft_s / b.ttft_s)
        if all(r.ok for r in firsts + twins):
            last_ratio.append(max(r.ttft_s for r in firsts) / max(r.ttft_s for r in twins))
        bursts_kept.append({"lengths": lengths, "first": [r.ttft_s for r in firsts], "twin": [r.ttft_s for r in twins]})
    worst = max(pairs, key=lambda p: p["first"] / p["twin"], default=None)
    worst_trace = [] if worst is None else trace_window(trace, worst["first_sent"] - 0.001,
                                                        worst["first_sent"] + worst["first"] + 0.002)
    return {"one": summary(one), "one_ratio": summary(one_ratio), "pairs": pairs, "worst_pair_trace": worst_trace,
            "burst": summary(burst),
            "burst_ratio": summary(burst_ratio), "burst_last_ratio": summary(last_ratio), "bursts": bursts_kept,
            "failed": 2 * requests + 16 * bursts - 2 * len(one) - 2 * len(burst)}


async def sweep(http, prompts: Callable[[int], list[int]], c: int, n: int = 16, prompt: int = 128, out: int = 128) -> dict:
    gate = asyncio.Semaphore(c)

    async def one():
        async with gate:
            return await stream_request(http, COMPLETIONS, completion_body(prompts(prompt), out))

    start = time.perf_counter()
    samples = await asyncio.gather(*(one() for _ in range(n)))
    wall = time.perf_counter() - start
    tokens = sum(s.tokens_received for s in samples)
    return {"c": c, "requests": n, "tokens": tokens, "seconds": wall, "tok_s": tokens / wall,
            "ok": sum(s.ok for s in samples)}


async def sweeps(http, prompts: Callable[[int], list[int]]) -> list[dict]:
    return [await sweep(http, prompts, c) for c in (1, 8)]


def burst_elsewhere(url: str, bodies: list[dict]) -> tuple[float, float, list[tuple[bool, float | None]]]:
    """`bodies` sent together and streamed from this process, another user's client: (when sent, when all were
    answered, (ok, TTFT) each). Sent from the streams' own client, the burst's requests took its event loop from
    their chunks and stretched the gaps it measured (the daemon's own ITL histogram stayed under 20 ms while the
    client saw 33-35 ms)."""
    async def send() -> tuple[float, float, list[tuple[bool, float | None]]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            t0 = time.perf_counter()  # CLOCK_MONOTONIC: the same clock in every process
            samples = await asyncio.gather(*(stream_request(http, COMPLETIONS, b) for b in bodies))
            return t0, time.perf_counter(), [(s.ok, s.ttft_s) for s in samples]
    return asyncio.run(send())


def cgroup_cpu() -> dict[str, int]:
    """This cgroup's CPU counters (cgroup v2 cpu.stat: usage_usec, nr_throttled, throttled_usec ...), {} where
    there is no such file."""
    try:
        text = Path("/sys/fs/cgroup/cpu.stat").read_text()
    except OSError:
        return {}
    return {k: int(v) for k, v in (line.split() for line in text.splitlines() if len(line.split()) == 2)}


def trace_window(trace: Path | None, lo: float, hi: float) -> list[dict]:
    """The daemon's step trace (RADIANCED_STEP_TRACE, engine/step_trace.py) between two of this machine's
    perf_counter times: the rows that overlap them (a round that began before `lo` and ran into it
    included: it may be the stall). The daemon is still appending: a last line without its newline is
    left out."""
    if trace is None or not trace.exists():
        return []
    rows = [json.loads(line) for line in trace.read_text().split("\n")[:-1] if line]
    return [r for r in rows if r["t"] <= hi and r.get("end", r["t"]) >= lo]


async def prefill_burst(http, prompts: Callable[[int], list[int]], url: str, watch=contextlib.nullcontext,
                        trace: Path | None = None) -> dict:
    """`watch()` (a context manager) spans the streams' 0.3 s of decoding before the burst, and the burst.
    `stall_trace`: the daemon's step trace from 3 ms before the longest gap began to 1 ms after it ended."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as other:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(other, burst_elsewhere, url, [])  # started and imported before the streams
        throttled_before = cgroup_cpu()
        kinds_before = await step_kinds(http)
        streams = [asyncio.create_task(stream_request(http, COMPLETIONS, completion_body(prompts(64), 1024)))
                   for _ in range(4)]
        with watch():
            await asyncio.sleep(0.3)  # their prefill done, their decode under way (1,024 tokens: ~2 s on the H200)
            hist_before = Snapshot.parse((await http.get("/metrics")).text)
            t_burst, t_end, burst = await loop.run_in_executor(
                other, burst_elsewhere, url, [completion_body(prompts(2000), 1) for _ in range(8)])
        hist_after = Snapshot.parse((await http.get("/metrics")).text)
        throttled = {k: v - throttled_before.get(k, 0) for k, v in cgroup_cpu().items()}
        running = await asyncio.gather(*streams)
    kinds = {k: (c - kinds_before.get(k, (0, 0))[0], t - kinds_before.get(k, (0, 0))[1])
             for k, (c, t) in (await step_kinds(http)).items()}
    itl = [g for s in running for g in s.itl_s]
    during = []  # (gap, when it ended after the burst was sent) for the gaps that ended while it was served
    for s in running:
        at = s.sent_at + (s.ttft_s or 0.0)
        for gap in s.itl_s:
            at += gap
            if t_burst <= at <= t_end:
                during.append((gap, at - t_burst))
    after, before = counter_totals(hist_after), counter_totals(hist_before)
    gap, ended = max(during, default=(0.0, 0.0))
    return {"itl_all": summary(itl), "itl_during_burst": summary([g for g, _ in during]),
            "gaps_during": [g for g, _ in during],
            "burst_seconds": t_end - t_burst,
            "burst_ttft": summary([ttft for ok, ttft in burst if ok]),
            "longest_gaps": [{"gap_ms": 1e3 * g, "ended_ms": 1e3 * e} for g, e in sorted(during, reverse=True)[:8]],
            "running_ok": sum(s.ok for s in running), "burst_ok": sum(ok for ok, _ in burst),
            "steps": {k: {"steps": c, "mean_ms": 1000 * t / c if c else None} for k, (c, t) in kinds.items()},
            "burst_histograms": histogram_deltas(hist_before, hist_after),
            # cudaMalloc and cudaFree while the burst is served (a free synchronizes the device)
            "burst_allocator": {n: after[n] - before[n] for n in ALLOCATOR},
            # the cgroup's CPU quota during the burst ({} where there is none to read): throttled_usec > 0 is the
            # whole machine's processes held off the CPU, a cause the step trace's runq_s would show too
            "cgroup_cpu": throttled,
            "stall_trace": trace_window(trace, t_burst + ended - gap - 0.003, t_burst + ended + 0.001) if gap else []}


async def prefill_bursts(http, prompts: Callable[[int], list[int]], url: str, repeats: int,
                         trace: Path | None = None) -> dict:
    """The burst `repeats` times: the first one's whole record, each one's p99 against its own median (and the
    step trace around its longest gap), and all of their gaps during a burst pooled against the runs' median
    (one burst's p99 is its third-largest gap)."""
    runs = [await prefill_burst(http, prompts, url, trace=trace) for _ in range(repeats)]
    median = pct([r["itl_all"]["p50"] for r in runs], 0.5)
    pooled = summary([g for r in runs for g in r["gaps_during"]])
    each = [{"p99_ms": 1e3 * r["itl_during_burst"]["p99"], "ratio": r["itl_during_burst"]["p99"] / r["itl_all"]["p50"],
             "burst_s": r["burst_seconds"], "longest_gap": r["longest_gaps"][:1], "stall_trace": r["stall_trace"],
             "cgroup_cpu": r["cgroup_cpu"]}
            for r in runs if r["itl_during_burst"]["n"]]
    return runs[0] | {"repeats": each, "pooled": pooled | {"median": median}}


PARTS = ("ttft", "sweep", "prefill_burst", "burst_gil")


async def measure(url: str, pid: int, args, res: dict) -> None:
    """Each part's rows into `res` as it ends (a run cut short keeps what it measured), with its time. The burst
    runs twice: measured, then again with the GIL's holders sampled (tools/gil_sample.py)."""
    prompts = prompt_source()
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        before = await serving_builds(http)
        res["serving_builds_before"] = before
        for name, part in (("ttft", lambda: ttft_rows(http, prompts, args.requests, args.bursts, args.trace)),
                           ("sweep", lambda: sweeps(http, prompts)),
                           ("prefill_burst", lambda: prefill_bursts(http, prompts, url, args.burst_repeats,
                                                                    args.trace)),
                           ("burst_gil", lambda: gil_burst(http, prompts, url, pid))):
            if name not in args.parts:
                continue
            t0 = time.perf_counter()
            res[name] = await part()
            res["serving_builds"] = await serving_builds(http) - before
            print(f"  {name}: {time.perf_counter() - t0:.1f} s", flush=True)


async def gil_burst(http, prompts: Callable[[int], list[int]], url: str, pid: int) -> dict:
    gil = GilSample(pid)
    burst = await prefill_burst(http, prompts, url, watch=lambda: gil)
    return {"gil": gil.summary(), "itl_during_burst": burst["itl_during_burst"], "steps": burst["steps"]}


def start(flags: list[str], cache: Path, site: Path | None) -> tuple[ChildDaemon, float, list[str]]:
    """The daemon started on the kernel cache `cache`, with `site` (a sitecustomize's folder) first on its
    PYTHONPATH only: (the daemon, seconds to ready, what its log said of warm-up)."""
    os.environ["TRITON_CACHE_DIR"] = str(cache)
    path = os.environ.get("PYTHONPATH")
    if site is not None:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(site), path)))
    t0 = time.monotonic()
    try:
        d = ChildDaemon.start(flags)
    finally:
        if path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = path
    seconds = time.monotonic() - t0
    said = [ln for ln in d.log().splitlines()
            if re.search(r"warm-up|kernel cache|step graphs|ready|GIL switch interval", ln)]
    return d, seconds, said


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--bursts", type=int, default=25)
    ap.add_argument("--model", type=Path, help="an existing .rad (default: write the synthetic model)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="set in the daemon's environment (repeatable), e.g. CUDA_MODULE_LOADING=EAGER: does "
                         "the first/twin gap come from CUDA loading each library kernel at its first launch?")
    ap.add_argument("--name", default="bench_served", help="the result file's name, DIR/NAME.json")
    ap.add_argument("--burst-repeats", type=int, default=5, help="prefill bursts measured (their gaps pooled)")
    ap.add_argument("--one-start", action="store_true",
                    help="start the daemon once (an empty kernel cache) and measure that one: the serving rows "
                         "without the warm restart's start-up time")
    ap.add_argument("--switch-interval-ms", type=float,
                    help="the daemon's GIL switch interval (sys.setswitchinterval, set by a sitecustomize on its "
                         "PYTHONPATH; Python's default is 5 ms): does a step thread waiting for the GIL while the "
                         "event loop runs Python stretch the steps of a prefill burst?")
    ap.add_argument("--parts", type=lambda v: v.split(","), default=list(PARTS),
                    help=f"the parts measured, comma-separated (default all: {','.join(PARTS)})")
    ap.add_argument("flags", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if unknown := sorted(set(args.parts) - set(PARTS)):
        ap.error(f"--parts: no part {', '.join(unknown)} (the parts: {', '.join(PARTS)})")
    args.out.mkdir(parents=True, exist_ok=True)
    for kv in args.env:
        key, sep, value = kv.partition("=")
        if not sep:
            ap.error(f"--env wants KEY=VALUE, got {kv!r}")
        os.environ[key] = value
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    flags = flags or ["--placement", "resident", "--max-num-seqs", "8"]
    with tempfile.TemporaryDirectory(dir="/var/tmp" if Path("/var/tmp").is_dir() else None) as d:
        args.trace = Path(d) / "step-trace.jsonl"  # the daemons' rounds (engine/step_trace.py), for the stalls
        os.environ["RADIANCED_STEP_TRACE"] = str(args.trace)
        model = args.model
        if model is None:
            from tools.make_synthetic import make_synthetic
            t0 = time.monotonic()
            model = make_synthetic(Path(d) / "m.rad", layers=args.layers, zipf=1.0, progress=False,  # on the CPU:
                                   device="cuda" if torch.cuda.is_available() else "cpu")  # 212 s for 8 layers
            torch.cuda.empty_cache()  # the daemon plans the card's free memory: leave it what generating took
            print(f"synthetic model written in {time.monotonic() - t0:.1f} s", flush=True)
        flags = ["--model", str(model), *flags]
        result = {"flags": flags, "layers": args.layers, "env": args.env, "switch_interval_ms": args.switch_interval_ms,
                  "step_trace": True}  # each round writes a JSON line: since 2026-12-04 (session 25)
        site = None
        if args.switch_interval_ms is not None:
            site = Path(d) / "site"
            site.mkdir()
            (site / "sitecustomize.py").write_text(
                f"import sys\nsys.setswitchinterval({args.switch_interval_ms / 1000!r})\n"
                f"print('bench_served: GIL switch interval', sys.getswitchinterval(), 's', file=sys.stderr)\n")
        cache = Path(d) / "kernels"
        daemon, cold, said = start(flags, cache, site)
        print(f"cold start-up to ready: {cold:.1f} s", flush=True)
        result["startup"] = {"cold_s": cold, "cold_log": said}
        if args.one_start:
            result["startup"].update(warm_s=None, warm_log=said)
        else:
            daemon.stop()
            daemon, warm, said = start(flags, cache, site)
            result["startup"].update(warm_s=warm, warm_log=said)
            print(f"start-up to ready: cold cache {cold:.1f} s, warm restart {warm:.1f} s", flush=True)
        try:
            asyncio.run(measure(daemon.url, daemon.proc.pid, args, result))
        finally:
            result["exit"] = daemon.stop()
            result["log_tail"] = daemon.log()[-4000:]
            (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    print("\n".join(served_lines(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
