"""tools/bench_served.py's result as the lines it prints: each part that ran (a run cut short prints what it has)."""

from __future__ import annotations

from tools.gil_sample import lines as gil_lines


def lines(result: dict) -> list[str]:
    out = ["    " + line[-200:] for line in result.get("startup", {}).get("warm_log", [])]
    t = result.get("ttft")
    if t:
        for k in ("one", "one_ratio", "burst", "burst_ratio", "burst_last_ratio"):
            v = t[k]
            if v["n"]:
                out.append(f"TTFT {k:12s} n={v['n']:4d} p50 {v['p50']:.3f} p99 {v['p99']:.3f} max {v['max']:.3f}")
        out.append(f"failed requests: {t['failed']}; kernel builds while serving: {result['serving_builds']:.0f}")
    s = result.get("sweep")
    if s:
        out.append(f"c-sweep: c=1 {s[0]['tok_s']:.0f} tok/s, c=8 {s[1]['tok_s']:.0f} tok/s "
                   f"({s[1]['tok_s'] / s[0]['tok_s']:.2f}x)")
    if t and t.get("worst_pair_trace"):
        out.append("the daemon's step trace while the worst first/twin pair's first request was out:")
        out += trace_lines(t["worst_pair_trace"])
    pb = result.get("prefill_burst")
    if pb:
        out += _burst(pb)
        for i, e in enumerate(pb.get("repeats", [])):
            if e.get("stall_trace"):
                gap = e["longest_gap"][0]
                out.append(f"the daemon's step trace around burst {i}'s longest gap ({gap['gap_ms']:.1f} ms, ended "
                           f"{gap['ended_ms']:.0f} ms after the burst was sent):")
                out += trace_lines(e["stall_trace"])
    g = result.get("burst_gil")
    if g:
        out.append("the burst again, the GIL sampled (0.3 s of the streams, then the burst):")
        out += gil_lines(g["gil"])
    return out


def _burst(pb: dict) -> list[str]:
    i, b = pb["itl_all"], pb["itl_during_burst"]
    during = (f"during it p99 {b['p99'] * 1e3:.1f} ms max {b['max'] * 1e3:.1f} ms ({b['p99'] / i['p50']:.2f}x the "
              f"median, {b['n']} gaps)" if b["n"] else "no gap ended during it")
    out = [f"prefill burst (8 x 2,000 tokens) under 4 decoding streams: ITL p50 {i['p50'] * 1e3:.1f} ms p99 "
           f"{i['p99'] * 1e3:.1f} ms; {during}; the burst took {pb['burst_seconds']:.2f} s",
           *_pooled(pb),
           "  its longest gaps (ms, ended ms after the burst was sent): "
           + ", ".join(f"{g['gap_ms']:.1f} at {g['ended_ms']:.0f}" for g in pb["longest_gaps"]),
           "  its steps: " + ", ".join(f"{k} {v['steps']:.0f} of {v['mean_ms']:.2f} ms"
                                      for k, v in pb["steps"].items() if v["steps"]),
           "  during it, the CUDA allocator: " + ", ".join(f"{k} {v:.4g}" for k, v in pb["burst_allocator"].items())]
    for name, by_labels in pb["burst_histograms"].items():
        for labels, counts in by_labels.items():
            out.append(f"  during it, {name}{{{labels}}}: " + ", ".join(f"<={le} {n:.0f}" for le, n in counts.items()
                                                                         if n))
    return out


def trace_lines(rows: list[dict]) -> list[str]:
    """engine/step_trace.py's rows (a window of them), times in ms from the first."""
    if not rows:
        return []
    t0 = min(r["t"] for r in rows)

    def at(t: float) -> str:
        return f"{1e3 * (t - t0):+.2f}"

    def ms(s) -> str:
        return "-" if s is None else f"{1e3 * s:.2f}"

    out = []
    for r in sorted(rows, key=lambda r: r["t"]):
        if r["k"] == "round":
            out.append(f"  {at(r['t'])} round: inbox {r['inbox']}, plan {ms(r['plan_s'])} ms, launch "
                       f"{r['launch']} in {ms(r['launch_s'])} ms (CPU {ms(r['launch_cpu_s'])}), collect "
                       f"{r['collect']} own {ms(r['own_s'])} ms, ends {at(r['end'])}"
                       + (f"; since the last round: runnable off-CPU {ms(r.get('runq_s'))} ms, the process's CPU "
                          f"{ms(r['proc_cpu_s'])} ms" if r.get("proc_cpu_s") is not None else ""))
        elif r["k"] == "http":
            out.append(f"  {at(r['t'])} http {r['id']}: body {ms(r['body_s'])} ms, prepare {ms(r['prepare_s'])} ms")
        elif r["k"] == "submit":
            out.append(f"  {at(r['t'])} submit {r['id']} ({r['prompt']} tokens)")
        else:
            out.append(f"  {at(r['t'])} dispatch {r['events']} events (posted {at(r['posted'])})")
    return out


def _pooled(pb: dict) -> list[str]:
    """The repeated bursts' line, where the run repeated them."""
    if "pooled" not in pb:
        return []
    p, each = pb["pooled"], pb["repeats"]
    if not p["n"]:
        return [f"  {len(each)} bursts: no gap ended during them"]
    return [f"  {len(each)} bursts pooled: during them p99 {p['p99'] * 1e3:.1f} ms = {p['p99'] / p['median']:.2f}x the "
            f"median ({p['n']} gaps); each burst's p99 / median: " + ", ".join(f"{e['ratio']:.2f}" for e in each)]
