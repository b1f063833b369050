"""tools/bench_compact_tiers.py's dry run on the CPU: every section runs, and the report's numbers follow from
its records (the slots each format gets for the same bytes, the bytes floor of a resident step)."""

from __future__ import annotations

import json

import pytest

from tools import bench_compact_tiers as bct


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("compact")
    assert bct.main(["--out", str(out), "--quick", "--formats", "bf16,int4", "--dir", str(out)]) == 0
    return json.loads((out / "compact_tiers.json").read_text()), (out / "compact_tiers.md").read_text()


def test_every_section_ran(results):
    res, _ = results
    for name in ("ceilings", "model_bf16", "model_int4", "slots_bf16_10", "slots_int4_25", "resident_int4"):
        assert res[name]["status"] == "ok", name
    assert res["model_int4"]["expert_format"] == "q4_0"
    assert res["model_int4"]["routed_experts"] == res["model_bf16"]["routed_experts"]


def test_the_same_slot_bytes_for_every_format(results):
    res, _ = results
    experts, ref = res["model_bf16"]["routed_experts"], res["model_bf16"]["slot_bytes"]
    for share in bct.SHARES:
        pct = round(share * 100)
        assert res[f"slots_bf16_{pct}"]["expert_slots"] == round(share * experts)
        int4, bf16 = res[f"slots_int4_{pct}"]["expert_slots"], round(share * experts)
        assert int4 == min(experts, bf16 * ref // res["model_int4"]["slot_bytes"]) > bf16


def test_the_floor_counts_each_lookup_once(results):
    res, md = results
    run = res["resident_int4"]["runs"][0]
    extent, dense = res["resident_int4"]["extent_bytes"], res["model_int4"]["dense_bytes"]
    lookups = sum(s["lookups"] for s in run["steps"]) / len(run["steps"])
    share, step_bytes = bct.floor_share(run, extent, dense, 1e9)
    assert step_bytes == dense + lookups * extent
    assert share == pytest.approx(step_bytes / 1e9 / (sum(s["s"] for s in run["steps"]) / len(run["steps"])))
    assert "int4 decode c=1, 10% of bf16's slot bytes" in md and "CPU dry run" in md
