"""tools/bench_spec_tiers.py's dry run on the CPU: at each slot share the plain, n-gram and forced-draft rows run
over the tiers, the forced drafts accept what they force, and verifying leaves the greedy tokens as they were.
Structure and counts, no timing."""

from __future__ import annotations

import json

from tools import bench_spec_tiers


def test_forced_drafts_accept_what_they_force_and_keep_the_plain_tokens(tmp_path):
    assert bench_spec_tiers.main(["--out", str(tmp_path), "--quick", "--dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "spec_tiers.json").read_text())
    assert [p["share"] for p in res["points"]] == list(bench_spec_tiers.COVERAGE)
    for point in res["points"]:
        plain, every, half, none = (point[k] for k in ("spec0", "forced_none", "forced_half", "forced_all"))
        assert plain["drafted"] == 0 and plain["tokens"] > 0
        assert every["accepted"] == every["drafted"] > 0  # every draft right
        assert 0 < half["accepted"] < half["drafted"]
        assert none["accepted"] == 0 < none["drafted"]  # every first draft wrong: none accepted
        assert all(point[f"forced_{w}"]["same_tokens"] for w in bench_spec_tiers.FORCED)
        assert all("out" not in row for row in point.values() if isinstance(row, dict))
    md = (tmp_path / "spec_tiers.md").read_text()
    assert md.count("forced") == 3 * len(res["points"])
    assert not list(tmp_path.glob("*.rad"))  # the model is removed
