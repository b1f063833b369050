"""tools/bench_served.py's readings: percentiles of its samples, and the daemon's /metrics around its parts
(kernel builds while serving, allocator and garbage-collector counters, step kinds, the burst's histograms)."""

from __future__ import annotations

import httpx

from radianced.bench.scrape import Snapshot

BUILDS = "radiance_kernel_builds_total"  # a sample's name as /metrics writes it (Snapshot.values' keys)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(xs: list[float]) -> dict:
    return {"n": len(xs), "p50": pct(xs, 0.5), "p99": pct(xs, 0.99), "max": max(xs)} if xs else {"n": 0}


async def serving_builds(http: httpx.AsyncClient) -> float:
    snap = Snapshot.parse((await http.get("/metrics")).text)
    return sum(v for (name, labels), v in snap.values.items() if name == BUILDS and ("phase", "serving") in labels)


# torch's CUDA allocator (cudaMalloc, cudaFree, retries) and its pinned host allocator (cudaHostAlloc: calls, seconds)
DEVICE_ALLOCATOR = ("mallocs", "frees", "retries")
ALLOCATOR = DEVICE_ALLOCATOR + ("host_allocs", "host_alloc_s")


async def counters(http: httpx.AsyncClient) -> dict[str, float]:
    """From the daemon's /metrics: `counter_totals`."""
    return counter_totals(Snapshot.parse((await http.get("/metrics")).text))


def counter_totals(snap: Snapshot) -> dict[str, float]:
    """torch's CUDA allocator counters (ALLOCATOR), the garbage collector's collections and seconds
    (radiance_gc_pause_seconds), and the engine steps' count, wall seconds (radiance_step_duration_seconds)
    and own seconds on the device (radiance_step_own_seconds, every kind): a slow request's time is in its
    steps or around them."""
    def total(name: str) -> float:
        return sum(v for (n, _), v in snap.values.items() if n == name)

    out = {n: snap.total(f"radiance_cuda_allocator_{n}") for n in DEVICE_ALLOCATOR}
    out.update(host_allocs=snap.total("radiance_cuda_host_allocs"),
               host_alloc_s=snap.total("radiance_cuda_host_alloc_seconds"))
    out.update(gc_count=total("radiance_gc_pause_seconds_count"), gc_s=total("radiance_gc_pause_seconds_sum"),
               steps=total("radiance_step_duration_seconds_count"), step_s=total("radiance_step_duration_seconds_sum"),
               own_s=total("radiance_step_own_seconds_sum"))
    return out


async def step_kinds(http: httpx.AsyncClient) -> dict[str, tuple[float, float]]:
    """kind -> (steps, seconds) of the daemon's radiance_step_own_seconds (decode, mixed, prefill)."""
    snap = Snapshot.parse((await http.get("/metrics")).text)
    out: dict[str, list[float]] = {}
    for (name, labels), v in snap.values.items():
        for i, part in enumerate(("count", "sum")):
            if name == f"radiance_step_own_seconds_{part}":
                out.setdefault(dict(labels)["kind"], [0.0, 0.0])[i] += v
    return {k: (c, t) for k, (c, t) in out.items()}


# the daemon's histograms read around the burst: where a client's long gap comes from (the engine's own ITL is
# taken as the loop hands tokens to their streams; a step's wall time; its device time by kind; the finished steps'
# tokens' wait for the event loop; the garbage collector's pauses, which stop both threads)
BURST_HISTOGRAMS = ("radiance_inter_token_latency_seconds", "radiance_step_duration_seconds",
                    "radiance_step_own_seconds", "radiance_step_loop_wait_seconds", "radiance_step_launch_seconds",
                    "radiance_step_launch_wait_seconds", "radiance_gc_pause_seconds")


def bucket_counts(snap: Snapshot, name: str) -> dict[str, dict[str, float]]:
    """A histogram's cumulative bucket counts: {label values ('' when none): {le: count}}."""
    out: dict[str, dict[str, float]] = {}
    for (n, labels), v in snap.values.items():
        if n == f"{name}_bucket":
            d = dict(labels)
            le = d.pop("le")
            out.setdefault(",".join(d.values()), {})[le] = v
    return out


def histogram_deltas(before: Snapshot, after: Snapshot) -> dict:
    """BURST_HISTOGRAMS' observations between two reads, per bucket (not cumulative): {name: {labels: {le: n}}}."""
    out = {}
    for name in BURST_HISTOGRAMS:
        a, b = bucket_counts(before, name), bucket_counts(after, name)
        out[name] = {}
        for labels, counts in b.items():
            les = sorted(counts, key=float)
            cum = [counts[le] - a.get(labels, {}).get(le, 0.0) for le in les]
            out[name][labels] = {le: c - (cum[i - 1] if i else 0.0) for i, (le, c) in enumerate(zip(les, cum))}
    return out
