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
    pb = result.get("prefill_burst")
    if pb:
        out += _burst(pb)
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


def _pooled(pb: dict) -> list[str]:
    """The repeated bursts' line, where the run repeated them."""
    if "pooled" not in pb:
        return []
    p, each = pb["pooled"], pb["repeats"]
    if not p["n"]:
        return [f"  {len(each)} bursts: no gap ended during them"]
    return [f"  {len(each)} bursts pooled: during them p99 {p['p99'] * 1e3:.1f} ms = {p['p99'] / p['median']:.2f}x the "
            f"median ({p['n']} gaps); each burst's p99 / median: " + ", ".join(f"{e['ratio']:.2f}" for e in each)]
