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


def test_a_run_cut_short_prints_what_it_has():
    result = json.loads(H200.read_text())
    del result["sweep"], result["prefill_burst"]
    text = "\n".join(lines(result))
    assert "TTFT one" in text and "c-sweep" not in text and "prefill burst" not in text
    assert lines({}) == []
