"""The workloads of `radiancectl bench run`, each measured the same way.

`measured` reads /metrics, starts the energy meter, runs the requests, stops
the meter and reads /metrics again once the daemon is idle, so a row's server
counters and energy belong to its requests only. Prompts of exact lengths are
token ids drawn from a seeded generator, different for every request, so one
request's prompt is never a prefix-cache hit for the next (the multi-turn row
is the one meant to hit). Ids stay below `PROMPT_ID_RANGE`'s top, inside any
vocabulary the daemon serves. The generator's seed joins a per-run nonce and a
counter, so two runs against one daemon share no prompt either.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from radianced.bench.client import Sample, chat_body, completion_body, stream_request
from radianced.bench.daemon_process import tree_rss_mib
from radianced.bench.energy import EnergyMeter, EnergyReading
from radianced.bench.loop_lag import LoopLag
from radianced.bench.quality import Reference, compare
from radianced.bench.result import WorkloadResult
from radianced.bench.scrape import ServerDelta, Snapshot
from radianced.bench.sizes import DaemonLimits, Sizes
from radianced.bench.stats import Distribution, slope_per_minute

PROMPT_ID_RANGE = (32, 384)  # ordinary tokens in every model here: above SmolLM2's specials (0..16), below the
# tiny test models' (397..399); byte-level tokens in the Qwen and Llama vocabularies
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
IDLE_WAIT_S = 10.0  # how long to wait for the daemon's running and waiting gauges to reach 0 after a workload
MEMORY_SAMPLE_S = 5.0  # the stability pass reads the daemon's RSS this often
OVERLOAD_HOLD_S = 2.0  # a burst of ~200 requests on kept-alive connections arrives in well under a second
FILLER = "The quick brown fox jumps over the lazy dog while the keeper counts the ships. "


@dataclass
class BenchContext:
    """What every workload needs: the client, the sizes, the meter, and a progress callback."""

    http: httpx.AsyncClient
    sizes: Sizes
    limits: DaemonLimits
    model: str  # the served model's name (/v1/models)
    meter: EnergyMeter | None  # None: energy not measured
    daemon_pid: int | None  # known when the bench started the daemon: its RSS is then reported
    progress: Callable[[str, int, int], None]  # (workload, requests done, requests in it)
    nonce: int = field(default_factory=time.time_ns)  # this run's part of every prompt seed
    busy_itl_s: float | None = None  # ITL p50 at the sweep's highest concurrency (sizes the overload's outputs)
    seed: int = 0  # prompts drawn so far


def prompt_ids(n: int, seed: str) -> list[int]:
    """`n` token ids, the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(*PROMPT_ID_RANGE) for _ in range(n)]


async def snapshot(http: httpx.AsyncClient) -> Snapshot:
    r = await http.get("/metrics")
    r.raise_for_status()
    return Snapshot.parse(r.text)


async def idle_snapshot(http: httpx.AsyncClient) -> Snapshot:
    """/metrics once nothing runs or waits (or after IDLE_WAIT_S): the counters of the last step are in."""
    deadline = time.monotonic() + IDLE_WAIT_S
    while True:
        snap = await snapshot(http)
        busy = (snap.gauge("radiance_sequences_running") or 0) + (snap.gauge("radiance_sequences_waiting") or 0)
        if not busy or time.monotonic() > deadline:
            return snap
        await asyncio.sleep(0.05)


async def measured(ctx: BenchContext, work: Awaitable[list[Sample]]
                   ) -> tuple[tuple[Sample, ...], ServerDelta, EnergyReading | None, Distribution]:
    """The work's samples, the daemon's /metrics over it, its energy, and the client's own loop lag
    meanwhile (bench/loop_lag.py)."""
    before = await idle_snapshot(ctx.http)
    if ctx.meter:
        ctx.meter.start()
    lag = LoopLag()
    lag.start()
    samples = await work
    client_lag = await lag.stop()
    energy = ctx.meter.stop() if ctx.meter else None
    after = await idle_snapshot(ctx.http)
    return tuple(samples), ServerDelta.between(before, after), energy, client_lag


async def bounded(ctx: BenchContext, name: str, path: str, bodies: list[dict], concurrency: int) -> list[Sample]:
    """Send every body with at most `concurrency` in flight (vLLM's --max-concurrency); samples in send order."""
    gate = asyncio.Semaphore(concurrency)
    done = 0

    async def one(body: dict) -> Sample:
        nonlocal done
        async with gate:
            sample = await stream_request(ctx.http, path, body)
        done += 1
        ctx.progress(name, done, len(bodies))
        return sample

    return list(await asyncio.gather(*(one(b) for b in bodies)))


async def row(ctx: BenchContext, name: str, kind: str, bodies: list[dict], concurrency: int) -> WorkloadResult:
    """A row of /v1/completions requests, at most `concurrency` in flight."""
    samples, server, energy, lag = await measured(ctx, bounded(ctx, name, COMPLETIONS, bodies, concurrency))
    return WorkloadResult(name, kind, concurrency, samples, server, energy, client_lag=lag)


def _next_seed(ctx: BenchContext) -> str:
    ctx.seed += 1
    return f"{ctx.nonce}-{ctx.seed}"


# -- the workloads ----------------------------------------------------------------


async def warm_up(ctx: BenchContext) -> None:
    """One short request outside every row (first-call costs are not part of any workload)."""
    await stream_request(ctx.http, COMPLETIONS, completion_body(prompt_ids(16, _next_seed(ctx)), 4))


async def decode(ctx: BenchContext) -> list[WorkloadResult]:
    """A short prompt, a long output: the decode speed of one sequence."""
    s = ctx.sizes
    bodies = [completion_body(f"Story {_next_seed(ctx)}. {s.decode_prompt}", s.decode_tokens)
              for _ in range(s.decode_requests)]
    return [await row(ctx, "decode", "decode", bodies, 1)]


async def prefill(ctx: BenchContext) -> list[WorkloadResult]:
    """A long prompt and one output token: TTFT is the prefill time."""
    rows = []
    for n in ctx.sizes.prefill_lengths:
        body = completion_body(prompt_ids(n, _next_seed(ctx)), 1)
        rows.append(await row(ctx, f"prefill {n}", "prefill", [body], 1))
    return rows


async def sweep(ctx: BenchContext) -> list[WorkloadResult]:
    """Concurrency c = 1, 2, 4, 8, 16: aggregate tok/s, TPOT, TTFT and ITL at each."""
    s = ctx.sizes
    rows = []
    for c in s.sweep:
        bodies = [completion_body(prompt_ids(s.sweep_prompt_tokens, _next_seed(ctx)), s.sweep_tokens)
                  for _ in range(c * s.sweep_rounds)]
        rows.append(await row(ctx, f"sweep c={c}", "sweep", bodies, c))
    if rows:
        ctx.busy_itl_s = rows[-1].summary.itl.p50
    return rows


async def overload(ctx: BenchContext) -> list[WorkloadResult]:
    """--max-num-seqs + --max-queue + 32 requests at once: exactly the 32 beyond should get 429, and no
    admitted request may fail or end short. The count is exact only while no admitted request has finished
    before the last refusal: the connections are opened first (so the burst is only the requests), and the
    notes give both times so a run on a very fast model can tell."""
    n, tokens = ctx.sizes.overload_requests, _overload_tokens(ctx)
    bodies = [completion_body(prompt_ids(16, _next_seed(ctx)), tokens) for _ in range(n)]
    await asyncio.gather(*(ctx.http.get("/health") for _ in range(n)))  # n keep-alive connections, open
    samples, server, energy, lag = await measured(ctx, bounded(ctx, "overload", COMPLETIONS, bodies, n))
    t0 = min(x.sent_at for x in samples)
    answered = {status: [x.sent_at + x.e2e_s - t0 for x in samples if x.status == status and x.e2e_s is not None]
                for status in (200, 429)}
    notes = {"sent": n, "max_tokens": tokens, "admissible": ctx.limits.admissible,
             "expected_429": n - ctx.limits.admissible,
             "got_429": sum(x.status == 429 for x in samples),
             "server_errors": sum(x.status >= 500 for x in samples),
             "cut_short": sum(x.cut_short for x in samples),
             "last_429_s": max(answered[429], default=None), "first_finish_s": min(answered[200], default=None)}
    return [WorkloadResult("overload", "overload", n, samples, server, energy, notes, lag)]


def _overload_tokens(ctx: BenchContext) -> int:
    """Output tokens per overload request: the sizes' count, or more on a fast model, so that the first
    admitted request decodes for about OVERLOAD_HOLD_S (at the sweep's busiest ITL) while the burst arrives."""
    s = ctx.sizes
    if not ctx.busy_itl_s:
        return s.overload_tokens
    return max(s.overload_tokens, min(math.ceil(OVERLOAD_HOLD_S / ctx.busy_itl_s), ctx.limits.max_model_len // 2))


async def multi_turn(ctx: BenchContext) -> list[WorkloadResult]:
    """Two turns of one chat: turn 2 resends turn 1, so its TTFT shows prefix reuse (cached_tokens)."""
    s = ctx.sizes
    overhead, per_filler = await _filler_tokens(ctx)
    story = f"Conversation {_next_seed(ctx)}. " + FILLER * max(1, (s.turn_prompt_tokens - overhead) // per_filler)
    first = [{"role": "user", "content": story + "Summarize this in one line."}]

    async def turns() -> list[Sample]:
        one = await stream_request(ctx.http, CHAT, chat_body(first, s.turn_tokens))
        ctx.progress("multi-turn", 1, 2)
        second = first + [{"role": "assistant", "content": "".join(one.pieces)},
                          {"role": "user", "content": "Now say it in five words."}]
        two = await stream_request(ctx.http, CHAT, chat_body(second, s.turn_tokens))
        ctx.progress("multi-turn", 2, 2)
        return [one, two]

    samples, server, energy, lag = await measured(ctx, turns())
    one, two = samples
    notes = {"ttft_turn1_s": one.ttft_s, "ttft_turn2_s": two.ttft_s, "prompt_turn1": one.prompt_tokens,
             "prompt_turn2": two.prompt_tokens, "cached_turn2": two.cached_tokens}
    return [WorkloadResult("multi-turn", "multi-turn", 1, samples, server, energy, notes, lag)]


async def _filler_tokens(ctx: BenchContext) -> tuple[int, int]:
    """(prompt tokens of a chat message with no FILLER, tokens per FILLER) in the daemon's tokenizer: two
    one-token requests outside every row, so the first turn fits the context whatever the vocabulary."""
    lengths = []
    for k in (0, 4):
        body = chat_body([{"role": "user", "content": f"Conversation 0. {FILLER * k}Summarize."}], 1)
        sample = await stream_request(ctx.http, CHAT, body)
        if sample.prompt_tokens is None:
            raise RuntimeError(f"the daemon answered {sample.status} to a 1-token chat request: {sample.error}")
        lengths.append(sample.prompt_tokens)
    return lengths[0], max(1, (lengths[1] - lengths[0]) // 4)


async def stability(ctx: BenchContext) -> list[WorkloadResult]:
    """--full only: fixed concurrency for stability_s seconds; no error, a flat RSS and GPU memory, and the
    KV back to idle afterwards."""
    s = ctx.sizes
    if not s.stability_s:
        return []
    c, end = s.stability_concurrency, time.monotonic() + s.stability_s
    rss: list[tuple[float, float]] = []

    async def worker() -> list[Sample]:
        out = []
        while time.monotonic() < end:
            body = completion_body(prompt_ids(s.sweep_prompt_tokens, _next_seed(ctx)), s.sweep_tokens)
            out.append(await stream_request(ctx.http, COMPLETIONS, body))
        return out

    async def work() -> list[Sample]:
        watch = asyncio.ensure_future(_watch_rss(ctx, end, rss))
        per_worker = await asyncio.gather(*(worker() for _ in range(c)))
        await watch
        return sorted((x for w in per_worker for x in w), key=lambda x: x.sent_at)

    samples, server, energy, lag = await measured(ctx, work())
    gpu = [(p.t_s, p.memory_mib) for p in energy.samples] if energy else []
    notes = {"seconds": s.stability_s, "errors": sum(not x.ok for x in samples),
             "rss_mib_per_min": slope_per_minute(*zip(*rss)) if len(rss) > 1 else "not measured",
             "gpu_mib_per_min": slope_per_minute(*zip(*gpu)) if len(gpu) > 1 else "not measured",
             "kv_util_after_idle": server.kv_util_after}
    return [WorkloadResult("stability", "stability", c, samples, server, energy, notes, lag)]


async def _watch_rss(ctx: BenchContext, end: float, out: list[tuple[float, float]]) -> None:
    """(seconds, RSS MiB) of the daemon and its children (its HTTP front, --tp's ranks) every MEMORY_SAMPLE_S
    until `end`; nothing without its pid."""
    if ctx.daemon_pid is None:
        return
    import psutil

    proc, t0 = psutil.Process(ctx.daemon_pid), time.monotonic()
    while time.monotonic() < end:
        out.append((time.monotonic() - t0, tree_rss_mib(proc)))
        ctx.progress("stability", int(time.monotonic() - t0), int(ctx.sizes.stability_s))
        await asyncio.sleep(MEMORY_SAMPLE_S)


async def quality(ctx: BenchContext) -> list[WorkloadResult]:
    """Greedy output against the stored reference for the served model; no row when there is none."""
    ref = Reference.find(ctx.model)
    if ref is None:
        return []
    body = completion_body(ref.prompt_ids, len(ref.token_ids), ignore_eos=False)
    samples, server, energy, lag = await measured(ctx, bounded(ctx, "quality", COMPLETIONS, [body], 1))
    notes = compare(ref, samples[0].pieces)
    return [WorkloadResult("quality", "quality", 1, samples, server, energy, notes, lag)]


WORKLOADS = {"decode": decode, "prefill": prefill, "sweep": sweep, "overload": overload, "multi-turn": multi_turn,
             "stability": stability, "quality": quality}  # `bench run --workloads` names, in the order they run


async def run_all(ctx: BenchContext, only: frozenset[str] | None = None) -> list[WorkloadResult]:
    """Every workload in order (or those named in `only`), after one warm-up request."""
    await warm_up(ctx)
    rows: list[WorkloadResult] = []
    for name, workload in WORKLOADS.items():
        if only is None or name in only:
            rows += await workload(ctx)
    return rows
