"""The report's checks, JSON and Markdown on hand-built rows; the plots drawn from them; the client's loop lag."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

from radianced.bench.energy import EnergyReading
from radianced.bench.plots import draw
from radianced.bench.loop_lag import LoopLag
from radianced.bench.report import CLIENT_BOUND_MARK, HEADER, Report, _hit_rate
from radianced.bench.scrape import ServerDelta
from radianced.bench.result import WorkloadResult
from radianced.bench.stats import Distribution
from tests.bench.samples import row, sample, server

OVERLOAD_NOTES = {"sent": 4, "admissible": 2, "expected_429": 2, "got_429": 2, "server_errors": 0, "cut_short": 0}


def _rows(got_429: int = 2) -> list[WorkloadResult]:
    return [row("sweep c=1", "sweep", [sample(tokens=4)]),
            row("sweep c=2", "sweep", [sample(tokens=4), sample(tokens=4, sent_at=0.1)]),
            row("overload", "overload", [sample(), sample(), sample(status=429), sample(status=429)],
                OVERLOAD_NOTES | {"got_429": got_429}),
            row("quality", "quality", [sample()], {"match": True})]


def test_a_consistent_run_passes_every_check():
    report = Report({"model": "m"}, tuple(_rows()))
    assert report.checks() == {"tokens_counted_equal_tokens_received": True, "overload_429_equal_excess": True,
                               "no_5xx": True, "no_stream_cut_short": True, "no_error_outside_overload": True,
                               "quality_matches_reference": True, "server_counts_equal_client_counts": True}
    assert report.passed


def test_a_wrong_429_count_fails_the_run():
    report = Report({}, tuple(_rows(got_429=1)))
    assert report.checks()["overload_429_equal_excess"] is False and not report.passed


def test_the_server_counting_other_tokens_fails_the_run():
    rows = _rows()
    rows[0] = row("sweep c=1", "sweep", [sample(tokens=4)], generated=5)
    assert Report({}, tuple(rows)).checks()["server_counts_equal_client_counts"] is False


def test_checks_of_workloads_not_run_are_none_not_failures():
    report = Report({}, (row("decode", "decode", [sample()]),))
    checks = report.checks()
    assert checks["overload_429_equal_excess"] is None and checks["quality_matches_reference"] is None
    assert report.passed


def test_json_keeps_every_sample_and_markdown_has_a_row_per_workload():
    report = Report({"model": "m", "limits": {"max_num_seqs": 2}}, tuple(_rows()))
    doc = json.loads(json.dumps(report.to_json()))
    assert [w["name"] for w in doc["workloads"]] == ["sweep c=1", "sweep c=2", "overload", "quality"]
    assert [len(w["samples"]) for w in doc["workloads"]] == [1, 2, 4, 1]
    assert doc["workloads"][0]["energy"] == "not measured"
    assert doc["workloads"][2]["summary"]["status_counts"] == {"200": 2, "429": 2}
    md = report.markdown()
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert table[0] == "| " + " | ".join(HEADER) + " |" and len(table) == 1 + 4
    assert "| sweep c=2 | 2 | 2 | 2 | 8 |" in md and "- overload_429_equal_excess: pass" in md


def test_the_hit_rate_cell_gives_the_decode_steps_rate_beside_a_prompts():
    """A row whose prompt was prefilled in its window: the whole row's rate, and its decode steps' (the one the
    plan predicts); a row of decode steps alone, or of no routed model, one figure."""
    mixed = ServerDelta(2000, 1600, 0, 0, 0, 0, 0, {}, 0.0, 0.0, 0.0, decode_lookups=1000, decode_hits=900)
    alone = ServerDelta(1000, 900, 0, 0, 0, 0, 0, {}, 0.0, 0.0, 0.0, decode_lookups=1000, decode_hits=900)
    older = ServerDelta(1000, 900, 0, 0, 0, 0, 0, {}, 0.0, 0.0, 0.0)  # a daemon without the counters by step kind
    dense = ServerDelta(0, 0, 0, 0, 0, 0, 0, {}, 0.0, 0.0, 0.0)
    assert [_hit_rate(d) for d in (mixed, alone, older, dense)] == ["80.0% (decode 90.0%)", "90.0%", "90.0%", "-"]


def test_energy_gives_joules_per_token_and_mean_watts():
    r = row("decode", "decode", [sample(tokens=10)])
    r = WorkloadResult(r.name, r.kind, 1, r.samples, r.server, EnergyReading(50.0, 2.0, 1, (), update_s=0.1))
    assert r.joules_per_token == 5.0 and r.energy.mean_w == 25.0
    assert "| 5.000 | 25 |" in Report({}, (r,)).markdown()


def test_a_row_too_short_for_the_energy_counter_says_so():
    r = row("decode", "decode", [sample(tokens=10)])
    r = WorkloadResult(r.name, r.kind, 1, r.samples, r.server, EnergyReading(0.0, 0.05, 1, (), update_s=0.1))
    assert r.joules_per_token is None and r.energy.mean_w is None  # not 0 J: the counter had not moved yet
    md = Report({}, (r,)).markdown()
    assert "| too short | too short |" in md and "decode (0.05 s)" in md and "every 100 ms" in md
    assert Report({}, (r,)).to_json()["workloads"][0]["energy"]["resolved"] is False


def test_plots_are_drawn_for_the_data_there_is(tmp_path):
    rows = _rows()
    assert [p.name for p in draw(rows, tmp_path)] == ["concurrency.png", "itl.png"]  # a dense model, no NVML
    moe = [row("sweep c=1", "sweep", [sample(tokens=4)], lookups=100, hits=75)]
    assert [p.name for p in draw(moe, tmp_path)] == ["concurrency.png", "itl.png", "hit_rate.png"]
    assert all(p.stat().st_size > 1000 for p in tmp_path.iterdir())
    assert server().hit_rate is None


def test_a_row_whose_client_loop_lagged_past_its_itl_is_marked_as_timing_the_client():
    """ITL p50 here is 250 ms (sample's gap): a client loop lag p99 of 300 ms marks the row's TTFT and ITL
    and names it under the table; 10 ms does not; a row without a lag reading is never marked."""
    lagged, calm = (dataclasses.replace(row(name, "sweep", [sample(tokens=4)]), client_lag=Distribution.of(lags))
                    for name, lags in (("sweep c=1", [0.001, 0.3, 0.3]), ("sweep c=2", [0.001, 0.01])))
    report = Report({"model": "m"}, (lagged, calm, row("decode", "decode", [sample(tokens=4)])))
    table = {line.split(" | ")[0][2:]: line for line in report.markdown().splitlines() if line.startswith("| ")}
    assert table["sweep c=1"].count(CLIENT_BOUND_MARK) == 2
    assert CLIENT_BOUND_MARK not in table["sweep c=2"] and CLIENT_BOUND_MARK not in table["decode"]
    assert "time the client as much as the daemon: sweep c=1 (lag p99 300.0 ms)." in report.markdown()
    doc = report.to_json()["workloads"]
    assert [w["client_lag"] and w["client_lag"]["client_bound"] for w in doc] == [True, False, None]


def test_the_loop_lag_probe_sees_the_loop_held():
    async def held(ms: float) -> Distribution:
        lag = LoopLag(interval_s=0.002)
        lag.start()
        await asyncio.sleep(0.02)
        time.sleep(ms / 1000)  # the loop held: every callback waits, the probe's wake-up too
        await asyncio.sleep(0.02)
        return await lag.stop()

    got = asyncio.run(held(60))
    assert got.count > 2 and got.max >= 0.05
