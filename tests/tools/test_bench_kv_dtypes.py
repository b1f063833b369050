"""tools/bench_kv_dtypes.py's dry run on the CPU: every KV dtype's pool equals its receipt's, and every (c,
context) pair is stepped for each dtype. Structure, no timing."""

from __future__ import annotations

import json

from radianced.config import KV_CACHE_DTYPES
from tools import bench_kv_dtypes


def test_every_dtype_is_pooled_as_its_receipt_says_and_stepped(tmp_path):
    assert bench_kv_dtypes.main(["--out", str(tmp_path), "--dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "kv_dtypes.json").read_text())
    s = bench_kv_dtypes.QUICK
    assert list(res["dtypes"]) == list(KV_CACHE_DTYPES)
    tokens = [res["dtypes"][d]["pool"]["receipt_tokens"] for d in KV_CACHE_DTYPES]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)  # narrower codes, more tokens
    for row in res["dtypes"].values():
        assert row["pool"]["receipt_tokens"] == row["pool"]["allocatable_tokens"]
        assert sorted(row["steps"]) == sorted(f"{c}x{n}" for n in s.contexts for c in s.batches)
        assert all(len(t) == s.steps and min(t) > 0 for t in row["steps"].values())
    md = (tmp_path / "kv_dtypes.md").read_text()
    assert md.count(" = ") >= len(KV_CACHE_DTYPES) and "k6_v4" in md
    assert not list(tmp_path.glob("*.rad"))  # the model is removed
