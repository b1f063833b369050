"""The daemon's own warm-up requests through its HTTP socket (server/self_warmup.py): sent before ready,
admitted while loading only with the process's token, and counted nowhere."""

from __future__ import annotations

import asyncio
import re
import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radianced.card import Card
from radianced.config import Config
from radianced.engine.driver import AsyncEngine
from radianced.engine.engine import Engine
from radianced.model.rad import RadFile
from radianced.server.http import build_app
from radianced.server.metrics import Metrics
from radianced.server.self_warmup import WARM_UP_HEADER, SelfWarmupError, address_of, warm_up_http
from radianced.server.state import Phase
from tests.server.conftest import API_KEY, CARD_MIB, MAX_MODEL_LEN, client, start_daemon
from tests.server.front_pair import front_pair
from tests.server.test_http import PROMPT_IDS


@pytest.mark.parametrize("family,host,reached", [(socket.AF_INET, "0.0.0.0", "127.0.0.1"),
                                                 (socket.AF_INET, "127.0.0.1", "127.0.0.1"),
                                                 (socket.AF_INET6, "::", "::1")])
def test_a_wildcard_bind_is_reached_on_loopback_at_its_port(family, host, reached):
    with socket.create_server((host, 0), family=family) as sock:
        assert address_of(sock) == (reached, sock.getsockname()[1])


def test_a_unix_socket_is_reached_at_its_path(sock_dir):
    path = f"{sock_dir}/http.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(path)
        assert address_of(sock) == path


def samples(text: str) -> dict[str, float]:
    return {s.name + str(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_daemon_warms_its_http_path_through_its_own_socket_before_ready_and_counts_none_of_it(
        tiny_model, sock_dir):
    d = start_daemon(tiny_model, "--http-socket", f"{sock_dir}/http.sock", "--api-key", API_KEY)
    try:
        log = d.log()
        assert "warm-up: 3 requests through the HTTP socket in" in log  # the tiny model has a chat template
        assert log.index("requests through the HTTP socket") < log.index("ready: serving")
        assert re.search(r"warm-up-http-[0-9a-f]{8}: POST /v1/chat/completions 200 in", log)  # marked as ours
        with client(d) as c:
            before = samples(c.get("/metrics").text)
            answer = c.post("/v1/completions", headers=d.headers(),
                            json={"prompt": PROMPT_IDS, "max_tokens": 2, "temperature": 0})
            after = samples(c.get("/metrics").text)
    finally:
        assert d.stop() == 0
    assert answer.status_code == 200
    assert not any(k.startswith("radiance_requests_total") for k in before)  # the warm-up's 3 are not counted
    assert before["radiance_prompt_tokens_total[]"] == 0 and before["radiance_generation_tokens_total[]"] == 0
    assert after["radiance_requests_total[('status', '200')]"] == 1
    assert after["radiance_prompt_tokens_total[]"] == len(PROMPT_IDS)


@pytest.fixture
async def loading_app(tiny_model):
    """The routes of a daemon still loading, its model set (as during the warm-up), and its state."""
    rad = RadFile.open(tiny_model)
    engine = AsyncEngine(Engine.build(rad, Config(card_mib=CARD_MIB, max_model_len=MAX_MODEL_LEN),
                                      Card.from_mib(CARD_MIB)))
    task = asyncio.create_task(engine.run())
    _, client = await front_pair(engine, Metrics(), "m", MAX_MODEL_LEN, 400)
    state = client.state
    assert state.phase is Phase.LOADING
    yield build_app(state), state
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    rad.close()


async def test_while_loading_only_a_request_with_the_processs_token_is_admitted(loading_app):
    app, state = loading_app
    body = {"prompt": PROMPT_IDS, "max_tokens": 2, "temperature": 0}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://radianced") as c:
        no_token_yet = await c.post("/v1/completions", json=body, headers={WARM_UP_HEADER: "guess"})
        state.warm_up_token = "0123456789abcdef"
        wrong = await c.post("/v1/completions", json=body, headers={WARM_UP_HEADER: "0123456789abcdeX"})
        none = await c.post("/v1/completions", json=body)
        right = await c.post("/v1/completions", json=body, headers={WARM_UP_HEADER: state.warm_up_token})
        state.warm_up_token = None
        after = await c.post("/v1/completions", json=body, headers={WARM_UP_HEADER: "0123456789abcdef"})
        health = await c.get("/health")
    for refused in (no_token_yet, wrong, none, after):
        assert refused.status_code == 503 and "still loading" in refused.json()["error"]["message"]
    assert right.status_code == 200 and len(right.json()["choices"][0]["text"]) > 0
    assert health.status_code == 503 and health.json() == {"status": "loading"}
    counted = samples((await state.engine.metrics())[0].decode())  # the daemon's registry, through the front
    assert counted["radiance_requests_total[('status', '503')]"] == 4
    assert "radiance_requests_total[('status', '200')]" not in counted  # the warm-up request is not counted


async def test_a_warm_up_request_not_answered_200_stops_the_warm_up_naming_it(sock_dir):
    path = f"{sock_dir}/http.sock"
    seen = []

    async def answer(reader, writer):
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(answer, path)
    async with server:
        with pytest.raises(SelfWarmupError, match=r"POST /v1/completions .* answered 503"):
            await warm_up_http(path, "tok", "m", chat=True, api_key="k")
    assert len(seen) == 1
    head = seen[0].decode().lower()
    assert f"{WARM_UP_HEADER}: tok" in head and "authorization: bearer k" in head
