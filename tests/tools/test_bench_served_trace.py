"""tools/bench_served.py's window on the daemon's step trace (engine/step_trace.py), while the daemon still appends."""

from __future__ import annotations

from tools.bench_served import trace_window


def test_the_window_keeps_rows_that_overlap_it_and_leaves_out_a_line_still_being_written(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"k":"round","t":1.0,"end":5.0}\n{"k":"http","t":3.0}\n{"k":"round","t":6.0,"end":7.0}\n'
                     '{"k":"submit","t":6.2}\n{"k":"dispatch","t":6.4,"pos')  # the last line: half written
    kept = [(r["k"], r["t"]) for r in trace_window(trace, 4.0, 6.5)]
    assert kept == [("round", 1.0), ("round", 6.0), ("submit", 6.2)]
    assert trace_window(tmp_path / "none.jsonl", 0.0, 9.0) == [] and trace_window(None, 0.0, 9.0) == []
