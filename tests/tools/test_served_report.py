"""tools/served_report.py on the H200's own bench_served result (7d62b54), whole and cut short."""

from __future__ import annotations

import json
from pathlib import Path

from tools.gil_sample import summarize
from tools.served_report import lines

H200 = Path(__file__).resolve().parents[2] / "bench/results/2026-12-03-h200-7d62b54-served.json"


def test_every_part_prints_and_the_burst_reads_against_the_median():
    result = json.loads(H200.read_text())
    result["burst_gil"] = {"gil": summarize("thread (1): radianced-step_0;f (radianced/x.py:1) 7\n", 1000, 0.01)}
    result["prefill_burst"] |= {"repeats": [{"p99_ms": 9.2, "ratio": 5.03, "burst_s": 0.28},
                                            {"p99_ms": 6.0, "ratio": 3.3, "burst_s": 0.3}],
                                "pooled": {"n": 568, "p50": 0.0019, "p99": 0.009, "max": 0.0092, "median": 0.0018}}
    text = "\n".join(lines(result))
    assert "TTFT one          n= 100" in text and "kernel builds while serving: 0" in text
    assert "c-sweep: c=1 695 tok/s, c=8 3113 tok/s (4.48x)" in text
    assert "during it p99 9.2 ms max 9.2 ms (5.03x the median, 284 gaps)" in text
    assert "thread (1): radianced-step_0: 7 samples, 70% of the wall time" in text
    assert "2 bursts pooled: during them p99 9.0 ms = 5.00x the median (568 gaps); each burst's p99 / median: " \
        "5.03, 3.30" in text


def test_the_step_trace_around_a_gap_prints_in_time_order_from_its_first_row():
    """Rows as the daemon writes them (engine/step_trace.py; the CPU's own burst of 2026-12-04)."""
    rows = [{"k": "dispatch", "t": 10.0, "posted": 9.9995, "events": 4},
            {"k": "round", "t": 9.9996, "inbox": 0, "plan_s": 0.00011, "launch": [4, 4, 4], "launch_s": 0.05099,
             "launch_cpu_s": 0.02261, "collect": [4, 4, 4], "own_s": 0.05094, "end": 10.05134, "runq_s": 0.0261,
             "proc_cpu_s": 0.0714},
            {"k": "http", "t": 10.0532, "id": "7759", "body_s": 0.00283, "prepare_s": 0.00189},
            {"k": "submit", "t": 10.0581, "id": "7759", "prompt": 2000}]
    text = "\n".join(lines({"prefill_burst": {
        "itl_all": {"n": 4, "p50": 0.0068, "p99": 0.029, "max": 0.053},
        "itl_during_burst": {"n": 1, "p50": 0.053, "p99": 0.053, "max": 0.053}, "burst_seconds": 0.3,
        "longest_gaps": [{"gap_ms": 52.9, "ended_ms": 12.3}], "steps": {}, "burst_allocator": {},
        "burst_histograms": {}, "repeats": [{"p99_ms": 52.9, "ratio": 7.8, "burst_s": 0.3,
                                             "longest_gap": [{"gap_ms": 52.9, "ended_ms": 12.3}],
                                             "stall_trace": rows}],
        "pooled": {"n": 1, "p50": 0.053, "p99": 0.053, "max": 0.053, "median": 0.0068}}}))
    at = text.index("the daemon's step trace around burst 0's longest gap (52.9 ms, ended 12 ms after")
    assert text[at:].splitlines()[1:] == [
        "  +0.00 round: inbox 0, plan 0.11 ms, launch [4, 4, 4] in 50.99 ms (CPU 22.61), collect [4, 4, 4] own "
        "50.94 ms, ends +51.74; since the last round: runnable off-CPU 26.10 ms, the process's CPU 71.40 ms",
        "  +0.40 dispatch 4 events (posted -0.10)",
        "  +53.60 http 7759: body 2.83 ms, prepare 1.89 ms",
        "  +58.50 submit 7759 (2000 tokens)"]


def test_a_run_cut_short_prints_what_it_has():
    result = json.loads(H200.read_text())
    del result["sweep"], result["prefill_burst"]
    text = "\n".join(lines(result))
    assert "TTFT one" in text and "c-sweep" not in text and "prefill burst" not in text
    assert lines({}) == []
