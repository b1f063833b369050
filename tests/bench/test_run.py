"""`radiancectl bench run --quick --start` against the real daemon on SmolLM2 (CPU), then its report read back.

Everything asserted is structure and internal consistency; no time is asserted
(the machine is shared and slow). About a minute on a loaded 2-core machine.
"""

from __future__ import annotations

import json

import pytest

from radianced.bench.energy import EnergyMeter
from radianced.ctl import main
from radianced.model.default import ensure_default_model

SEQS, QUEUE = 8, 8  # 16 admitted at once: the overload burst is 48, 32 of them refused
DAEMON = ["--card-mib", "2048", "--max-model-len", "512", "--max-num-seqs", str(SEQS), "--max-queue", str(QUEUE)]
WORKLOADS = ["decode", "prefill 128", "prefill 256", "sweep c=1", "sweep c=2", "sweep c=4", "sweep c=8",
             "sweep c=16", "overload", "multi-turn", "quality"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    try:
        ensure_default_model()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("bench")
    mp = pytest.MonkeyPatch()
    mp.setenv("RADIANCED_CPU_THREADS", "1")
    mp.setenv("OMP_NUM_THREADS", "1")
    try:
        status = main(["bench", "run", "--start", "--quick", "--out", str(out), "--", *DAEMON])
    finally:
        mp.undo()
    assert status == 0, (out / "bench.md").read_text() if (out / "bench.md").exists() else "no report"
    return out, json.loads((out / "bench.json").read_text())


def test_every_workload_is_present_and_every_check_passes(report):
    out, doc = report
    assert [w["name"] for w in doc["workloads"]] == WORKLOADS
    assert all(v is True for v in doc["checks"].values()), doc["checks"]
    assert doc["meta"]["limits"] == {"max_num_seqs": SEQS, "max_queue": QUEUE, "max_model_len": 512}
    md = (out / "bench.md").read_text()
    assert all(f"| {name} |" in md for name in WORKLOADS)
    assert {p.name for p in out.glob("*.png")} >= {"concurrency.png", "itl.png"}


def test_tokens_counted_equal_tokens_received_and_what_the_daemon_counted(report):
    _, doc = report
    for w in doc["workloads"]:
        ok = [s for s in w["samples"] if s["status"] == 200]
        for s in ok:
            assert s["done"] and s["error"] is None, w["name"]
            assert s["tokens_received"] == s["completion_tokens"] == len(s["pieces"]), w["name"]
        assert w["summary"]["output_tokens"] == sum(s["tokens_received"] for s in ok)
        assert w["server"]["generated_tokens"] == w["summary"]["output_tokens"], w["name"]
        assert w["server"]["prompt_tokens"] == sum(s["prompt_tokens"] for s in ok), w["name"]
        assert w["server"]["prefix_hit_tokens"] == sum(s["cached_tokens"] or 0 for s in ok), w["name"]
        assert w["summary"]["itl"]["count"] == sum(s["tokens_received"] - 1 for s in ok)  # one token per chunk
    by_name = {w["name"]: w for w in doc["workloads"]}
    for c in (1, 2, 4, 8, 16):
        sweep = by_name[f"sweep c={c}"]
        assert [s["tokens_received"] for s in sweep["samples"]] == [16] * c  # ignore_eos: exactly max_tokens
        assert {s["finish_reason"] for s in sweep["samples"]} == {"length"}
    assert [s["prompt_tokens"] for s in by_name["prefill 256"]["samples"]] == [256]


def test_the_overload_burst_gets_exactly_its_excess_as_429(report):
    _, doc = report
    w = next(w for w in doc["workloads"] if w["name"] == "overload")
    notes = w["notes"]
    assert {k: notes[k] for k in ("sent", "admissible", "expected_429", "got_429", "server_errors", "cut_short")} \
        == {"sent": SEQS + QUEUE + 32, "admissible": SEQS + QUEUE, "expected_429": 32, "got_429": 32,
            "server_errors": 0, "cut_short": 0}
    assert w["summary"]["status_counts"] == {"200": SEQS + QUEUE, "429": 32}
    assert [s["tokens_received"] for s in w["samples"] if s["status"] == 200] == [notes["max_tokens"]] * (SEQS + QUEUE)
    assert w["server"]["requests_by_status"] == {"200": SEQS + QUEUE, "429": 32}


def test_turn_two_reuses_turn_one_and_the_quality_row_matches_transformers(report):
    _, doc = report
    by_name = {w["name"]: w for w in doc["workloads"]}
    turns = by_name["multi-turn"]["notes"]
    assert turns["prompt_turn2"] > turns["prompt_turn1"] and 16 <= turns["cached_turn2"] < turns["prompt_turn2"]
    quality = by_name["quality"]["notes"]
    assert quality["match"] and quality["tokens_got"] == quality["tokens_expected"] == 39


def test_percentiles_are_ordered_and_energy_is_not_made_up(report):
    _, doc = report
    for w in doc["workloads"]:
        for metric in ("ttft", "tpot", "itl", "e2e"):
            d = w["summary"][metric]
            if d["count"]:
                assert d["p50"] <= d["p95"] <= d["p99"] <= d["max"], (w["name"], metric)
        if EnergyMeter.open() is None:
            assert w["energy"] == "not measured"
