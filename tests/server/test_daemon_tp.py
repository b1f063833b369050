"""The daemon with `--tp 2` on the CPU: rank 0 is the daemon, rank 1 a spawned worker (gloo over
127.0.0.1), against the same daemon with `--tp 1`, on the tiny qwen3_moe with every expert in its
card's host pool (4 slots a card). It prints one receipt block a card; completions (a batch at once,
greedy and seeded), chat, streaming and stop strings give `--tp 1`'s answers through httpx and the
openai SDK; /metrics and the control socket's status count every card's experts, and a saved expert
profile counts every card's routing (the --tp 1 profile of the same requests); SIGTERM drains the
streams in flight and the worker exits with the daemon; a killed worker stops the daemon with
status 1 and the rank named in its log.

One daemon of each for the module, started together (a --tp 2 start spawns a rank: seconds); the
drain test runs last of those and stops the --tp 2 one.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import time

import httpx
import msgspec
import openai
import psutil
import pytest

from radianced.model.convert import convert
from radianced.model.rad import RadFile
from radianced.model.tiny import make_tiny
from radianced.server import control
from radianced.server.control import ProfileSaveResult, StatusResult
from radianced.tiers.profile import Profile, profile_path
from tests.server.conftest import API_KEY, SERVED_NAME, start_daemon, wait_until_ready
from tests.server.test_daemon import STREAM, _stream, _until_draining, completion_tokens, finish_reason
from tests.server.test_http import CHAT, PROMPT_IDS, scrape

PROMPTS = ([5, 17, 2, 99, 41, 8, 23, 61, 7, 3, 150, 12], [44, 9, 300, 1], [250, 31, 77, 6, 18, 90, 11])
FLAGS = ("--host-pool-mib", "1", "--expert-slots", "4", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "8",  # 8: the 12-token prompts in 2 chunks
         "--api-key", API_KEY, "--served-model-name", SERVED_NAME)
K = 2  # the tiny qwen3_moe's experts per token
STARTUP_TIMEOUT_S = 90.0
ON_THE_CPU = {"CUDA_VISIBLE_DEVICES": ""}  # on a GPU machine too: --tp over NCCL is refused until it has run on cards


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    src = make_tiny("qwen3_moe", tmp_path_factory.mktemp("tiny-moe"))
    convert(src, src / "model.rad")
    return src / "model.rad"


@pytest.fixture(scope="module")
def daemons(moe_model):
    """(--tp 1, --tp 2), loading at the same time."""
    pair = [start_daemon(moe_model, *FLAGS, *tp, env=ON_THE_CPU, wait_ready=False, timeout_s=STARTUP_TIMEOUT_S)
            for tp in ((), ("--tp", "2"))]
    for d in pair:
        wait_until_ready(d, STARTUP_TIMEOUT_S)
    yield pair
    for d in pair:
        assert d.stop() == 0, d.log()[-3000:]


@pytest.fixture(scope="module")
def one(daemons):
    return daemons[0]


@pytest.fixture(scope="module")
def two(daemons):
    return daemons[1]


def _worker(d) -> psutil.Process:
    children = [p for p in psutil.Process(d.pid).children() if "spawn" in " ".join(p.cmdline())]
    assert len(children) == 1, children
    return children[0]


async def _complete(d) -> list[str]:
    async with httpx.AsyncClient(base_url=d.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        rs = await asyncio.gather(*(c.post("/v1/completions", json={"prompt": p, "max_tokens": 16, "temperature": 0,
                                                                     "ignore_eos": True}) for p in PROMPTS))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    return [r.json()["choices"][0]["text"] for r in rs]


async def test_a_batch_of_completions_gives_tp1s_and_the_log_has_a_receipt_block_a_card(one, two):
    assert await _complete(two) == await _complete(one)
    log = two.log()
    assert "card 0: query heads 0-1, KV heads 0-0, vocab rows 0-199, experts 0-3" in log
    assert "card 1: query heads 2-3, KV heads 1-1, vocab rows 200-399, experts 4-7" in log
    assert "total over 2 cards:" in log and "0 pinned on cards, 24 in host pools, 0 on disk" in log
    assert "expert slots: 8 at start (4, 4)" in log


def sdk(d) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{d.url}/v1", api_key=API_KEY, max_retries=0)


async def both(one, two, call):
    """`call(sdk)` against --tp 1 and --tp 2 (one after the other: each alone on its daemon)."""
    return await call(sdk(one)), await call(sdk(two))


async def test_completions_greedy_and_seeded_give_tp1s_tokens_and_logprobs(one, two):
    for extra in ({"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 1234}):
        a, b = await both(one, two, lambda api: api.completions.create(model=SERVED_NAME, prompt=PROMPT_IDS, max_tokens=20,
                                                             logprobs=0, extra_body={"ignore_eos": True}, **extra))
        assert b.choices[0].text == a.choices[0].text and b.choices[0].logprobs.tokens == a.choices[0].logprobs.tokens
        assert b.choices[0].logprobs.token_logprobs == pytest.approx(a.choices[0].logprobs.token_logprobs, abs=1e-4)
        assert (b.usage.prompt_tokens, b.usage.completion_tokens) == (len(PROMPT_IDS), 20)


async def test_chat_whole_and_streamed_gives_tp1s_answer(one, two):
    a, b = await both(one, two, lambda api: api.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=16,
                                                              temperature=0, extra_body={"ignore_eos": True}))
    assert b.choices[0].message.content == a.choices[0].message.content and b.usage == a.usage
    stream = await sdk(two).chat.completions.create(
        model=SERVED_NAME, messages=CHAT, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == a.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 16


async def test_a_stop_string_ends_the_text_where_tp1s_does(one, two):
    whole = await sdk(one).completions.create(model=SERVED_NAME, prompt=PROMPT_IDS, max_tokens=24,
                                                     temperature=0, extra_body={"ignore_eos": True})
    stop = whole.choices[0].text[8:11]  # three characters from the middle of the answer
    a, b = await both(one, two, lambda api: api.completions.create(model=SERVED_NAME, prompt=PROMPT_IDS, max_tokens=24,
                                                         temperature=0, stop=[stop]))
    assert b.choices[0].text == a.choices[0].text and stop not in b.choices[0].text
    assert b.choices[0].finish_reason == a.choices[0].finish_reason == "stop"


def _fed(d, max_tokens: int) -> int:
    """One greedy completion; the tokens it fed through the model (prompt + all but the last)."""
    with httpx.Client(base_url=d.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT_IDS, "max_tokens": max_tokens, "ignore_eos": True,
                                            "temperature": 0})
    assert r.status_code == 200, r.text
    return len(PROMPT_IDS) + r.json()["usage"]["completion_tokens"] - 1


def _quiet(d) -> StatusResult:
    """Status once no request runs and no step is left to collect: a stop string ends a request on the
    event loop, and the step thread may run a step or two for it before it takes the cancel
    (engine/driver.py); such a step's counts come in when it is collected, after `running` reads 0."""
    def status() -> StatusResult:
        return msgspec.convert(control.call(d.control_socket, "status"), StatusResult)

    last = status()
    while True:
        time.sleep(0.1)
        now = status()
        if now.running == 0 and now.steps == last.steps:
            return now
        last = now


def test_status_and_metrics_count_the_experts_of_both_cards(two):
    d = two
    before = _quiet(d).experts
    fed = _fed(d, 6)
    e = msgspec.convert(control.call(d.control_socket, "status"), StatusResult).experts
    assert (e.slots, e.pinned, e.host, e.disk) == (8, 0, 24, 0)  # 4 slots and 12 host experts a card
    # every fed token routed K experts in every MoE layer, each assignment counted by the card that owns it
    assert [a.routed - b.routed for a, b in zip(e.layers, before.layers)] == [K * fed] * 3
    assert all(0 <= x.hits <= x.lookups <= x.routed for x in e.layers)
    m = scrape(d)
    def total(name: str) -> float:  # the counters are by step kind
        return sum(m.get(f'{name}{{step="{k}"}}', 0) for k in ("decode", "mixed", "prefill"))

    assert total("radiance_expert_lookups_total") == sum(x.lookups for x in e.layers)
    assert total("radiance_expert_hits_total") == sum(x.hits for x in e.layers)


async def _saved(d, moe_model, replace: bool = False) -> dict[tuple[int, int], int]:
    """Save `d`'s expert profile (the model's own file) through the control socket; its counts."""
    result = msgspec.convert(await control.request(d.control_socket, "profile_save", {"replace": replace}),
                             ProfileSaveResult)
    with RadFile.open(moe_model) as rad:
        p = Profile.load_for(rad, result.path)
    return {(layer, e): p.count(layer, e) for layer in p.moe_layers for e in range(p.num_experts)}


async def test_a_saved_expert_profile_counts_every_cards_routing_as_tp1s_does(one, two, moe_model):
    """Each daemon's counts since its warm-up (the other card's restarted with rank 0's, so a layer's
    counts are status's `routed`), then what the same requests add: equal on --tp 1 and --tp 2, the
    experts of card 1 (4-7) among them: gathered to rank 0 when the save asks."""
    try:
        since_start = await _saved(two, moe_model, replace=True)
        status = msgspec.convert(await control.request(two.control_socket, "status"), StatusResult)
        routed = [x.routed for x in status.experts.layers]
        assert [sum(n for (layer, _e), n in since_start.items() if layer == i) for i in range(3)] == routed
        before = {d.pid: await _saved(d, moe_model, replace=True) for d in (one, two)}
        assert await _complete(two) == await _complete(one)
        added = [{k: n - before[d.pid][k] for k, n in (await _saved(d, moe_model, replace=True)).items()}
                 for d in (one, two)]
        assert added[1] == added[0] and sum(n for (_l, e), n in added[1].items() if e >= 4) > 0
        assert re.search(r"expert profile: the routing counts of 2 cards gathered in [\d.]+ ms \(3 layers x 8 "
                         r"experts\)", two.log())
    finally:
        profile_path(moe_model).unlink(missing_ok=True)


async def test_sigterm_lets_the_streams_finish_and_both_ranks_exit_0(two):
    d = two
    worker = _worker(d)
    long = {**STREAM, "max_tokens": 120}
    async with httpx.AsyncClient(base_url=d.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        started = [asyncio.Event() for _ in range(3)]
        streams = [asyncio.create_task(_stream(c, s, long)) for s in started]
        await asyncio.gather(*(s.wait() for s in started))
        d.proc.send_signal(signal.SIGTERM)
        await _until_draining(c)
        results = await asyncio.gather(*streams)
    assert d.stop(timeout=30) == 0, d.log()[-3000:]
    for events in results:
        assert events[-1] == "[DONE]" and finish_reason(events) == "length" and completion_tokens(events) == 120
    assert "SIGTERM: draining" in d.log()
    assert re.search(r"step broadcast to the other ranks: \d+ steps, [\d.]+ ms a step", d.log())
    worker.wait(10)


def test_a_killed_rank_stops_the_daemon_naming_it(moe_model):
    d = start_daemon(moe_model, *FLAGS, "--tp", "2", env=ON_THE_CPU, timeout_s=STARTUP_TIMEOUT_S)
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
