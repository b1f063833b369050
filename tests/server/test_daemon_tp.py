"""The daemon with `--tp 2` on the CPU: rank 0 is the daemon, rank 1 a spawned worker (gloo over
127.0.0.1). It serves the greedy completions of `--tp 1` on the tiny qwen3_moe, a batch of requests
at once, prints one receipt block a card, and a killed worker stops it with status 1 and the rank
named in its log."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import time

import httpx
import psutil
import pytest

from radianced.model.convert import convert
from radianced.model.tiny import make_tiny
from tests.server.conftest import start_daemon

PROMPTS = ([5, 17, 2, 99, 41, 8, 23, 61, 7, 3, 150, 12], [44, 9, 300, 1], [250, 31, 77, 6, 18, 90, 11])
FLAGS = ("--max-num-seqs", "4", "--max-num-batched-tokens", "8")  # 8: the 12-token prompt in 2 chunks


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    src = make_tiny("qwen3_moe", tmp_path_factory.mktemp("tiny-moe"))
    convert(src, src / "model.rad")
    return src / "model.rad"


async def _complete(url: str) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        rs = await asyncio.gather(*(c.post("/v1/completions", json={"prompt": p, "max_tokens": 16, "temperature": 0,
                                                                     "ignore_eos": True}) for p in PROMPTS))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    return [r.json()["choices"][0]["text"] for r in rs]


def _worker(d) -> psutil.Process:
    children = [p for p in psutil.Process(d.pid).children() if "spawn" in " ".join(p.cmdline())]
    assert len(children) == 1, children
    return children[0]


def test_tp2_serves_tp1s_greedy_completions(moe_model):
    one = start_daemon(moe_model, *FLAGS)
    try:
        expected = asyncio.run(_complete(one.url))
    finally:
        assert one.stop() == 0, one.log()[-3000:]
    two = start_daemon(moe_model, *FLAGS, "--tp", "2")
    worker = _worker(two)
    try:
        assert asyncio.run(_complete(two.url)) == expected
    finally:
        assert two.stop() == 0, two.log()[-3000:]
    log = two.log()
    assert "card 0: query heads 0-1, KV heads 0-0, vocab rows 0-199, experts 0-3" in log
    assert "card 1: query heads 2-3, KV heads 1-1, vocab rows 200-399, experts 4-7" in log
    assert "total over 2 cards:" in log and "24 pinned on cards, 0 in host pools, 0 on disk" in log
    assert re.search(r"step broadcast to the other ranks: \d+ steps, [\d.]+ ms a step", log)
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE


def test_a_killed_rank_stops_the_daemon_naming_it(moe_model):
    d = start_daemon(moe_model, *FLAGS, "--tp", "2")
    _worker(d).kill()
    start = time.monotonic()
    try:
        status = d.proc.wait(30)
    except subprocess.TimeoutExpired:
        d.stop(signal.SIGKILL, 5)
        pytest.fail(f"the daemon outlived its killed rank by 30 s:\n{d.log()[-3000:]}")
    assert status == 1, d.log()[-3000:]
    assert "rank 1 of --tp 2 ended: exit code -9; stopping" in d.log()
    assert time.monotonic() - start < 10
