"""RADIANCED_STEP_TRACE through the daemon as users run it: a request's HTTP arrival, its submit, the rounds
that served it and their dispatches, one JSON line each, in the daemon's own clock."""

from __future__ import annotations

import json

from tests.server.conftest import client, start_daemon


def test_the_trace_follows_a_request_from_its_body_to_its_last_token(tiny_model, tmp_path):
    trace = tmp_path / "trace.jsonl"
    d = start_daemon(tiny_model, env={"RADIANCED_STEP_TRACE": str(trace)})
    try:
        with client(d) as http:
            r = http.post("/v1/completions", json={"prompt": [5, 6, 7, 8, 9], "max_tokens": 4,
                                                   "ignore_eos": True})
            assert r.status_code == 200, r.text
            rid = r.headers["x-request-id"]
    finally:
        assert d.stop() == 0
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    (arrived,) = [r for r in rows if r["k"] == "http" and r["id"] == rid]
    (submitted,) = [r for r in rows if r["k"] == "submit" and r["id"] == rid]
    assert submitted["prompt"] == 5 and arrived["body_s"] >= 0 and arrived["prepare_s"] > 0
    assert arrived["t"] + arrived["body_s"] + arrived["prepare_s"] <= submitted["t"]
    served = [r for r in rows if r["k"] == "round" and r["t"] >= submitted["t"] and r["collect"]]
    assert sum(r["collect"][2] for r in served) >= 5 + 3  # its prompt, then 3 decodes after the first token
    dispatched = [r for r in rows if r["k"] == "dispatch" and r["t"] >= submitted["t"]]
    assert len(dispatched) >= 4 and all(r["posted"] <= r["t"] for r in dispatched)


def test_a_trace_file_the_daemon_cannot_open_stops_it_with_one_line(tiny_model, tmp_path):
    where = tmp_path / "no such folder" / "trace.jsonl"
    d = start_daemon(tiny_model, env={"RADIANCED_STEP_TRACE": str(where)}, wait_ready=False)
    assert d.proc.wait(timeout=120) == 1
    assert f"ERROR radianced: cannot start: RADIANCED_STEP_TRACE={where} cannot be opened for appending" in d.log()
