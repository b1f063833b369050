"""The OpenAI API of a running daemon, driven by real clients: the openai SDK, httpx, curl."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from radianced.card import Card
from radianced.config import Config
from radianced.engine.driver import AsyncEngine
from radianced.engine.engine import Engine
from radianced.engine.sampling_params import SamplingParams
from radianced.model.rad import RadFile
from radianced.server.limits import MAX_BODY_BYTES
from tests.server.conftest import API_KEY, CARD_MIB, MAX_MODEL_LEN, SERVED_NAME, client

PROMPT_IDS = [12, 250, 31, 77, 140, 9, 301, 45, 66, 199, 23, 5]  # plain tokens of the tiny vocabulary (400)
CHAT = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is a tiny model?"}]


def sdk(daemon) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{daemon.url}/v1", api_key=API_KEY, max_retries=0)


def scrape(daemon) -> dict[str, float]:
    """/metrics as {'name{label="v"}': value}, parsed by prometheus_client."""
    with client(daemon) as c:
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


async def wait_idle(daemon, timeout: float = 5.0) -> dict[str, float]:
    """Poll /metrics until no sequence runs or waits and no KV block is held; the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(daemon)
        if m["radiance_sequences_running"] == 0 and m["radiance_sequences_waiting"] == 0 \
                and m["radiance_kv_util"] == 0.0:
            return m
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {m}"
        await asyncio.sleep(0.05)


@pytest.fixture
async def local_engine(tiny_model):
    """The daemon's engine, in this process: same .rad, same flags, same card, on the daemon's device (a seed's
    draws differ between torch's CPU and CUDA generators)."""
    rad = RadFile.open(tiny_model)
    cfg = Config(card_mib=CARD_MIB, max_model_len=MAX_MODEL_LEN)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ae = AsyncEngine(Engine.build(rad, cfg, Card.from_mib(CARD_MIB, cuda=device == "cuda"), device))
    task = asyncio.create_task(ae.run())
    yield ae
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    rad.close()


async def local_run(ae: AsyncEngine, prompt_ids, params: SamplingParams):
    chunks = [c async for c in ae.generate(prompt_ids, params)]
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks


# -- the openai SDK ------------------------------------------------------------------


async def test_sdk_completion_gives_the_engines_tokens_text_and_logprobs_for_the_same_seed(daemon, local_engine):
    r = await sdk(daemon).completions.create(model=SERVED_NAME, prompt=PROMPT_IDS, max_tokens=24, temperature=0.9,
                                             top_p=0.95, seed=1234, logprobs=0,
                                             extra_body={"ignore_eos": True})
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, logprobs=0, ignore_eos=True)
    ids, text, chunks = await local_run(local_engine, PROMPT_IDS, params)
    tok = local_engine.tokenizer
    choice = r.choices[0]
    assert len(ids) == 24 and r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(PROMPT_IDS)
    assert choice.logprobs.tokens == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert choice.logprobs.token_logprobs == pytest.approx([c.logprobs[0] for c in chunks if c.token_ids], abs=1e-5)
    assert choice.text == text and choice.finish_reason == "length"
    assert r.model == SERVED_NAME and r.object == "text_completion"


async def test_sdk_chat_gives_the_engines_answer_for_the_same_seed(daemon, local_engine):
    r = await sdk(daemon).chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=20, seed=7,
                                                  temperature=0.7)
    tok = local_engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template(CHAT))
    ids, text, chunks = await local_run(local_engine, prompt,
                                        SamplingParams(max_tokens=20, seed=7, temperature=0.7))
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == chunks[-1].finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(ids))


async def test_sdk_streaming_chat_streams_the_same_answer_then_usage(daemon):
    api = sdk(daemon)
    whole = await api.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=16, seed=3,
                                              extra_body={"ignore_eos": True})
    stream = await api.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=16, seed=3,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-") and chunks[0].id != whole.id
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


async def test_sdk_lists_the_served_model(daemon):
    models = await sdk(daemon).models.list()
    assert [m.id for m in models.data] == [SERVED_NAME]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN


# -- curl and SSE --------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streams_sse_that_ends_with_done(daemon):
    body = json.dumps({"prompt": "the tiny model", "max_tokens": 10, "stream": True, "ignore_eos": True})
    out = subprocess.run(["curl", "-sS", "-N", "--fail-with-body", f"{daemon.url}/v1/completions",
                          "-H", f"Authorization: Bearer {API_KEY}", "-H", "Content-Type: application/json",
                          "-d", body], capture_output=True, text=True, timeout=30, check=True).stdout
    events = [e for e in out.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


# -- ids, metrics --------------------------------------------------------------------


def test_every_request_id_is_in_the_header_the_body_and_the_log(daemon):
    with client(daemon, headers=daemon.headers()) as c:
        r = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3})
        bad = c.post("/v1/chat/completions", json={"messages": []})
    rid = r.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{16}", rid) and r.json()["id"] == f"chatcmpl-{rid}"
    assert bad.status_code == 400 and bad.headers["x-request-id"] != rid
    ok, refused = (f"radianced.http: {rid}: POST /v1/chat/completions 200",
                   f"radianced.http: {bad.headers['x-request-id']}: POST /v1/chat/completions 400")
    log = daemon.log_with(ok, refused)
    assert re.search(rf"radianced.requests: {rid}: prompt \d+ tokens = \d+ reused \+ \d+ read", log)
    assert ok in log and refused in log


async def test_metrics_move_with_each_request(daemon):
    before = await wait_idle(daemon)
    with client(daemon, headers=daemon.headers()) as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT_IDS + PROMPT_IDS, "max_tokens": 9, "ignore_eos": True})
        again = c.post("/v1/completions", json={"prompt": PROMPT_IDS + PROMPT_IDS, "max_tokens": 2})
        c.post("/v1/completions", json={"prompt": PROMPT_IDS, "max_tokens": -1})
    assert r.status_code == 200 and again.status_code == 200
    after = await wait_idle(daemon)

    def moved(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved('radiance_requests_total{status="200"}') == 2
    assert moved('radiance_requests_total{status="400"}') == 1
    assert moved("radiance_prompt_tokens_total") == 2 * len(PROMPT_IDS) * 2
    generated = r.json()["usage"]["completion_tokens"] + again.json()["usage"]["completion_tokens"]
    assert moved("radiance_generation_tokens_total") == generated
    cached = [x.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for x in (r, again)]
    assert cached[1] == 16  # the 24-token prompt's one full block came from the prefix cache
    assert moved("radiance_prefix_cache_hit_tokens_total") == sum(cached)
    assert moved("radiance_time_to_first_token_seconds_count") == 2
    assert moved("radiance_e2e_request_latency_seconds_count") == 2
    assert moved("radiance_inter_token_latency_seconds_count") == generated - 2
    assert moved("radiance_step_duration_seconds_count") >= 9
    # every round waits for the event loop once (rounds that only launch included)
    assert moved("radiance_step_loop_wait_seconds_count") >= moved("radiance_step_duration_seconds_count")
    assert moved("radiance_step_loop_wait_seconds_sum") >= 0
    # a launch a step (the CPU launches and finishes a step in one round): its wall, and what of it the step
    # thread did not run
    assert moved("radiance_step_launch_seconds_count") == moved("radiance_step_duration_seconds_count")
    assert moved("radiance_step_launch_wait_seconds_count") == moved("radiance_step_launch_seconds_count")
    assert 0 <= moved("radiance_step_launch_wait_seconds_sum") <= moved("radiance_step_launch_seconds_sum")
    assert after["radiance_kv_util"] == 0.0


# -- errors ----------------------------------------------------------------------------


def _post(daemon, path, content: bytes | str | None = None, headers=None, **kw):
    with client(daemon, headers=daemon.headers() if headers is None else headers) as c:
        return c.post(path, content=content, **kw)


def test_malformed_json_is_a_400_with_an_openai_body(daemon):
    r = _post(daemon, "/v1/chat/completions", b'{"messages": [')
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"].startswith("the request body is not valid JSON")


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"max_tokens": 3}, "messages"),
    ("/v1/completions", {"prompt": [1, 2, 400]}, "prompt"),
])
def test_an_invalid_field_is_a_400_naming_it(daemon, path, body, param):
    r = _post(daemon, path, json.dumps(body))
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_prompt_plus_max_tokens_past_the_context_is_a_400_stating_both(daemon):
    r = _post(daemon, "/v1/completions", json.dumps({"prompt": PROMPT_IDS, "max_tokens": 250}))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_tokens"
    assert f"prompt ({len(PROMPT_IDS)} tokens) plus max_tokens (250)" in err["message"]
    assert f"(--max-model-len) {MAX_MODEL_LEN}" in err["message"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_a_missing_or_wrong_bearer_is_a_401(daemon, headers):
    r = _post(daemon, "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 1}), headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    with client(daemon) as c:  # probes and scrapers need no key
        assert c.get("/health").json() == {"status": "ready"}
        assert c.get("/metrics").status_code == 200


def test_a_body_over_the_cap_is_a_413(daemon):
    big = json.dumps({"prompt": "x" * MAX_BODY_BYTES, "max_tokens": 1})
    r = _post(daemon, "/v1/completions", big)
    assert r.status_code == 413 and "larger than 8388608 bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the cap holds while reading
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 65536 + 1):
            yield b"y" * 65536
        yield b'"}'

    assert _post(daemon, "/v1/completions", chunks()).status_code == 413


def test_unknown_model_and_path_are_404s_with_openai_bodies(daemon):
    r = _post(daemon, "/v1/completions", json.dumps({"model": "gpt-4", "prompt": "x"}))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with client(daemon) as c:
        r = c.get("/v1/engines")
    assert r.status_code == 404 and r.json()["error"]["message"].startswith("no route /v1/engines")


# -- clients that leave -------------------------------------------------------------------


async def test_a_stream_the_client_drops_is_cancelled_and_its_blocks_freed(daemon):
    before = await wait_idle(daemon)
    body = {"prompt": PROMPT_IDS * 4, "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=daemon.url, headers=daemon.headers()) as c:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.aiter_lines()
            while not (await lines.__anext__()).startswith("data: "):
                pass
            assert scrape(daemon)["radiance_kv_util"] > 0
    after = await wait_idle(daemon, timeout=2.0)
    assert after['radiance_requests_total{status="499"}'] - before.get('radiance_requests_total{status="499"}', 0) == 1
    assert after["radiance_generation_tokens_total"] - before["radiance_generation_tokens_total"] < 200


async def test_a_plain_request_the_client_drops_is_cancelled_too(daemon):
    before = await wait_idle(daemon)
    body = {"prompt": PROMPT_IDS * 4, "max_tokens": 200, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=daemon.url, headers=daemon.headers()) as c:
        task = asyncio.create_task(c.post("/v1/completions", json=body))
        while scrape(daemon)["radiance_sequences_running"] == 0:
            await asyncio.sleep(0.01)
        task.cancel()  # closes the connection mid-request
        await asyncio.gather(task, return_exceptions=True)
    after = await wait_idle(daemon, timeout=2.0)
    assert after['radiance_requests_total{status="499"}'] - before.get('radiance_requests_total{status="499"}', 0) == 1
    assert after["radiance_generation_tokens_total"] - before["radiance_generation_tokens_total"] < 200
