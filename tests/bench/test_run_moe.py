"""`bench run --quick --start` on a tiny MoE with 6 expert slots: the rows carry the daemon's expert counters
and the hit-rate plot is drawn. About 10 s. Structure and consistency only, no timing."""

from __future__ import annotations

import json

import pytest

from radianced.ctl import main
from radianced.model.convert import convert
from radianced.model.tiny import make_tiny

DAEMON = ["--card-mib", "256", "--max-model-len", "256", "--max-num-seqs", "4", "--max-queue", "4",
          "--host-pool-mib", "1", "--expert-slots", "6"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    src = make_tiny("qwen3_moe", tmp_path_factory.mktemp("tiny-moe"))
    convert(src, src / "model.rad")
    out = tmp_path_factory.mktemp("bench-moe")
    mp = pytest.MonkeyPatch()
    mp.setenv("RADIANCED_CPU_THREADS", "1")
    try:
        status = main(["bench", "run", "--start", "--quick", "--out", str(out), "--", "--model",
                       str(src / "model.rad"), *DAEMON])
    finally:
        mp.undo()
    assert status == 0
    return out, json.loads((out / "bench.json").read_text())


def test_every_row_that_ran_the_model_has_a_hit_rate_and_overflow_bytes(report):
    out, doc = report
    assert [w["name"] for w in doc["workloads"]] == ["decode", "prefill 128", "prefill 254", "sweep c=1", "sweep c=2",
                                                     "sweep c=4", "sweep c=8", "overload", "multi-turn"]
    for w in doc["workloads"]:
        d = w["server"]
        assert 0 < d["expert_lookups"] and 0 <= d["expert_hits"] <= d["expert_lookups"], w["name"]
        assert d["hit_rate"] == d["expert_hits"] / d["expert_lookups"]
        assert d["overflow_share"] == pytest.approx(1 - d["hit_rate"])
        assert (d["overflow_bytes"] > 0) == (d["expert_hits"] < d["expert_lookups"])
    assert all(doc["checks"][k] for k in doc["checks"] if k != "quality_matches_reference")
    assert doc["checks"]["quality_matches_reference"] is None  # no reference for a random model
    assert {p.name for p in out.glob("*.png")} >= {"concurrency.png", "itl.png", "hit_rate.png"}
