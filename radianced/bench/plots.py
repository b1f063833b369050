"""The report's PNG plots, drawn with matplotlib's Agg backend (no display needed).

- `concurrency.png`: aggregate output tok/s and TTFT p50/p95 against the sweep's concurrency;
- `itl.png`: the distribution of every inter-token gap of the sweep;
- `hit_rate.png`: output tok/s against expert hit rate and against overflow %, one point per decoding row
  (decode, sweep, stability: a prefill row's one token says nothing of tok/s) that routed experts (drawn
  only when the daemon reports expert lookups: a dense model has none);
- `power.png`: GPU power against GPU utilization, from NVML's samples (drawn only when energy was measured).
"""

from __future__ import annotations

from pathlib import Path

from radianced.bench.result import WorkloadResult

DECODING = ("decode", "sweep", "stability")  # rows whose output tok/s measures decoding


def draw(rows: list[WorkloadResult] | tuple[WorkloadResult, ...], folder: Path) -> list[Path]:
    """Write every plot the rows have data for into `folder`; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    out = []
    for name, plot in (("concurrency.png", _concurrency), ("itl.png", _itl), ("hit_rate.png", _hit_rate),
                       ("power.png", _power)):
        fig = plot(plt, rows)
        if fig is None:
            continue
        path = folder / name
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        out.append(path)
    return out


def _sweep(rows) -> list[WorkloadResult]:
    return [r for r in rows if r.kind == "sweep" and r.summary.ok]


def _concurrency(plt, rows):
    sweep = _sweep(rows)
    if not sweep:
        return None
    c = [r.concurrency for r in sweep]
    fig, (tps, ttft) = plt.subplots(1, 2, figsize=(10, 4))
    tps.plot(c, [r.summary.output_tok_s for r in sweep], "o-")
    tps.set(xscale="log", xlabel="concurrency", ylabel="output tok/s (aggregate)", title="throughput")
    for q in ("p50", "p95"):
        ttft.plot(c, [getattr(r.summary.ttft, q) * 1000 for r in sweep], "o-", label=q)
    ttft.set(xscale="log", xlabel="concurrency", ylabel="TTFT ms", title="time to first token")
    ttft.legend()
    for ax in (tps, ttft):
        ax.set_xticks(c, [str(x) for x in c])
    return fig


def _itl(plt, rows):
    gaps = [g * 1000 for r in _sweep(rows) for s in r.samples if s.ok for g in s.itl_s]
    if not gaps:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.hist(gaps, bins=50)
    ax.set(xlabel="inter-token latency ms", ylabel="gaps", title=f"ITL, every sweep request ({len(gaps)} gaps)")
    return fig


def _hit_rate(plt, rows):
    routed = [r for r in rows if r.kind in DECODING and r.server.hit_rate is not None and r.summary.output_tok_s]
    if not routed:
        return None
    fig, (hit, over) = plt.subplots(1, 2, figsize=(10, 4))
    tps = [r.summary.output_tok_s for r in routed]
    hit.scatter([r.server.hit_rate * 100 for r in routed], tps)
    hit.set(xlabel="expert hit rate %", ylabel="output tok/s", title="tok/s against hit rate")
    over.scatter([r.server.overflow_share * 100 for r in routed], tps)
    over.set(xlabel="overflow % (lookups read over the link)", ylabel="output tok/s", title="tok/s against overflow")
    for r, t in zip(routed, tps):
        hit.annotate(r.name, (r.server.hit_rate * 100, t), fontsize=7)
    return fig


def _power(plt, rows):
    points = [(p.util_pct, p.power_w) for r in rows if r.energy for p in r.energy.samples]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter(*zip(*points), s=6)
    ax.set(xlabel="GPU utilization %", ylabel="power W", title="power against utilization (NVML)")
    return fig
