"""tools/bench_peer_offload.py --quick: both systems run on the CPU, and the report's numbers add up.

One quick run (width / 16, 2 layers, vocab 4,096; radianced with half the experts' slots,
accelerate with half the model in memory and the rest on disk), shared by the tests
below. No timing is asserted: the checks are the JSON's structure, the token counts
against the steps, and the slab's counters against the routing's bounds.
"""

from __future__ import annotations

import json

import pytest

from tools.bench_peer_offload import main

TOKENS = 16  # --quick's greedy tokens per sequence
BATCHES = (1, 8)
TOP_K, EXPERTS, LAYERS = 8, 128, 2


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("peer")
    mp = pytest.MonkeyPatch()
    mp.setenv("RADIANCED_DISK_DIR", str(out))  # the model's two formats, removed at the end
    try:
        rc = main(["--quick", "--out", str(out)])
    finally:
        mp.undo()
    return rc, json.loads((out / "peer_offload.json").read_text()), (out / "peer_offload.md").read_text(), out


def test_the_quick_run_finishes_every_section(report):
    rc, res, _, out = report
    assert rc == 0
    assert {k: res[k]["status"] for k in ("env", "model", "ours", "theirs", "compare")} == dict.fromkeys(
        ("env", "model", "ours", "theirs", "compare"), "ok")
    assert res["quick"] and res["sizes"]["batches"] == list(BATCHES)
    assert not [p for p in out.iterdir() if p.name.startswith("radianced-peer-")]  # the model files are gone


@pytest.mark.parametrize("system", ["ours", "theirs"])
@pytest.mark.parametrize("batch", BATCHES)
def test_token_counts_add_up(report, system, batch):
    """Every sequence has its tokens; the first come from the prefill, the rest one per sequence a step."""
    r = report[1][system][f"b{batch}"]
    assert r["batch"] == batch and len(r["tokens"]) == batch
    assert [len(t) for t in r["tokens"]] == [TOKENS] * batch and not r["cut_at_deadline"]
    assert r["generated"] == batch * TOKENS
    assert r["decode_tokens"] == r["generated"] - batch == batch * r["decode_steps"]
    assert r["decode_steps"] == TOKENS - 1
    assert all(0 <= t < report[1]["model"]["vocab"] for seq in r["tokens"] for t in seq)


@pytest.mark.parametrize("batch", BATCHES)
def test_radianceds_slot_counters_are_consistent(report, batch):
    """Each layer of a step looks up each distinct expert its tokens chose once: between top_k and
    min(batch x top_k, experts) per layer; the overflow is the misses' bytes."""
    ours = report[1]["ours"]
    r = ours[f"b{batch}"]
    steps = r["decode_steps"]
    assert steps * LAYERS * TOP_K <= r["lookups"] <= steps * LAYERS * min(batch * TOP_K, EXPERTS)
    assert 0 <= r["hits"] <= r["lookups"] and r["hit_rate"] == r["hits"] / r["lookups"]
    assert r["overflow_bytes"] == (r["lookups"] - r["hits"]) * ours["extent_bytes"]
    assert r["overflow_bytes_per_token"] == r["overflow_bytes"] / r["decode_tokens"]
    assert ours["expert_slots"] == ours["experts"] // 2 == LAYERS * EXPERTS // 2


def test_accelerate_offloaded_part_of_the_model_and_the_map_covers_it(report):
    res = report[1]
    p = res["theirs"]["placement"]
    assert sum(p["bytes"].values()) == res["model"]["parameters_bytes"]
    assert sum(p["layers"].values()) == LAYERS and p["bytes"].get("disk", 0) > 0
    assert res["theirs"]["max_memory"] == {"cpu": res["model"]["parameters_bytes"] // 2}


def test_the_comparison_covers_every_token_of_both(report):
    cmp = report[1]["compare"]
    for b in BATCHES:
        c = cmp[f"b{b}"]
        assert c["compared"] == b * TOKENS and len(c["sequences"]) == b
        assert c["equal"] == sum(q["equal"] for q in c["sequences"]) <= c["compared"]
        for q in c["sequences"]:
            assert (q["first_difference"] is None) == (q["equal"] == q["compared"] == TOKENS)


def test_the_table_says_quick_first_and_has_a_row_per_measurement(report):
    md = report[2]
    assert md.startswith("**Quick run on the CPU")
    for row in ("| placement at the budget |", "| load |", "| TTFT b1,", "| decode b1, greedy |", "| TTFT b8,",
                "| decode b8, greedy |", "| greedy tokens b1 |", "| greedy tokens b8 |"):
        assert row in md
    assert "| section " not in md  # nothing failed or was skipped
