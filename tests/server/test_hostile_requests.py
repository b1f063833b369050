"""Hostile and huge requests (issue 19), through the real daemon: they get a fast 4xx naming the
problem, the event loop never blocks (/health answers while the hostile request is in flight: the one timing assertion, 250 ms
against the product's 50), slow clients are cut off, the API key stays off the command line, and a burst is
admitted up to the free sequence slots plus --max-queue. One test per finding, named for it; finding 4 (a
cancelled long prefill) is tests/engine/test_pacing.py's, finding 7 (profile --save paths) is in test_daemon_experts.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from radianced.model.rad import RadFile
from radianced.model.tokenizer import Tokenizer
from tests.server.conftest import start_daemon
from tests.server.test_http import PROMPT_IDS

KEY = "hostile-key-7d2e"
HEALTH_BOUND_S = 0.25


@pytest.fixture(scope="module")
def key_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("key") / "api-key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def d19(tiny_model, key_file):
    """Eight sequences, sixteen queued, one-second head and body timeouts, the key from a file."""
    d = start_daemon(tiny_model, "--max-num-seqs", "8", "--max-queue", "16", "--timeout-headers", "1",
                     "--timeout-body", "1", "--timeout-keep-alive", "1", "--api-key-file", key_file)
    yield d
    assert d.stop() == 0, d.log()[-3000:]


def api(d, **kw) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=d.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60, **kw)


async def while_in_flight(d, hostile) -> tuple[httpx.Response, list[float]]:
    """Run the `hostile` request (a coroutine) and poll /health on another connection until it is
    answered; its response and every /health latency (each asserted 200)."""
    async with httpx.AsyncClient(base_url=d.url, timeout=10) as probe:
        task = asyncio.ensure_future(hostile)
        latencies = []
        while True:
            t = time.perf_counter()
            assert (await probe.get("/health")).status_code == 200
            latencies.append(time.perf_counter() - t)
            if task.done():
                return await task, latencies
            await asyncio.sleep(0.005)


def error(r: httpx.Response) -> tuple[int, str | None, str]:
    e = r.json()["error"]
    return r.status_code, e["param"], e["message"]


async def test_19_1_a_megabyte_stop_string_is_a_fast_400_and_health_stays_fast(d19):
    async with api(d19) as c:
        body = {"prompt": "Hi", "max_tokens": 1, "stop": ["y" * 1_000_000]}
        r, latencies = await while_in_flight(d19, c.post("/v1/completions", json=body))
        assert error(r) == (400, "stop", "stop[0] is 1000000 characters long; a stop string may have at most 512")
        assert max(latencies) < HEALTH_BOUND_S, latencies
        # the most a request may ask (16 stops of 512 characters that keep almost matching) streams
        # 200 tokens with the stop check on every token, and the loop stays free
        stops = ["é" * 511 + chr(0x4E00 + i) for i in range(16)]
        body = {"prompt": PROMPT_IDS, "max_tokens": 200, "ignore_eos": True, "stop": stops}
        r, latencies = await while_in_flight(d19, c.post("/v1/completions", json=body))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 200
    assert max(latencies) < HEALTH_BOUND_S and len(latencies) > 3, latencies


async def test_19_2_a_huge_prompt_is_refused_before_tokenizing_and_health_stays_fast(d19, tiny_model):
    with RadFile.open(tiny_model) as rad:
        longest = Tokenizer.from_header(rad.header).max_token_bytes
    limit = 256 * longest
    message = (f"the prompt is 8000000 bytes: more than the 256 tokens of the context length (--max-model-len) "
               f"can hold, at most {longest} bytes a token of this model ({limit} bytes); shorten the prompt")
    async with api(d19) as c:
        r, latencies = await while_in_flight(d19, c.post("/v1/completions", json={"prompt": "x " * 4_000_000}))
        assert error(r) == (400, "prompt", message)
        assert max(latencies) < HEALTH_BOUND_S, latencies
        chat = {"messages": [{"role": "user", "content": "x " * 4_000_000}]}
        r, latencies = await while_in_flight(d19, c.post("/v1/chat/completions", json=chat))
        assert error(r) == (400, "messages", message)
        assert max(latencies) < HEALTH_BOUND_S, latencies
        # under the byte bound it is tokenized (on a worker thread), then refused for its tokens
        r = await c.post("/v1/completions", json={"prompt": "hello " * (limit // 6)})
    assert r.status_code == 400 and r.json()["error"]["message"].endswith(
        "and the context length (--max-model-len) is 256: no room for a single token; shorten the prompt")


DEEP = ("the request body is not valid JSON", "the request body nests JSON arrays or objects too deeply to decode "
        "(the limit is the interpreter's recursion depth, a thousand levels or more; a request needs a handful)")


@pytest.mark.parametrize("depth", [20_000, 100_000])  # past the limit of Python 3.11 (1,000) and 3.12 (C's, more)
async def test_19_3_deep_json_is_a_400_naming_the_nesting_on_both_endpoints(d19, depth):
    nest = b"[" * depth + b"]" * depth
    bodies = {"/v1/completions": b'{"prompt": "Hi", "extra": ' + nest + b"}",
              "/v1/chat/completions": b'{"messages": [{"role": "user", "content": "Hi"}], "x": {"y": ' + nest
                                      + b"}}"}
    async with api(d19) as c:
        for path, body in bodies.items():
            r, latencies = await while_in_flight(d19, c.post(path, content=body))
            assert error(r) == (400, None, DEEP[1]), path
            assert max(latencies) < HEALTH_BOUND_S, latencies
    assert "RecursionError" not in d19.log()


def _raw(d, data: bytes) -> socket.socket:
    host, port = d.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=20)
    sock.sendall(data)
    return sock


def _answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read to EOF (the server closes): the status, the headers, the body."""
    data = b""
    with sock:
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def _post_head(length: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: radianced\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def test_19_5_slow_bodies_and_heads_are_cut_off_with_a_json_408(d19):
    status, headers, body = _answer(_raw(d19, _post_head(100) + b'{"prompt":'))
    assert (status, headers["content-type"], headers["connection"]) == (408, "application/json", "close")
    assert json.loads(body)["error"]["message"] == ("the request body did not arrive within 1 s (--timeout-body); "
                                                   "send it whole, or raise --timeout-body for a slow link")
    status, headers, body = _answer(_raw(d19, b"POST /v1/completions HTTP/1.1\r\nHost: radi"))
    assert (status, headers["content-type"], headers["connection"]) == (408, "application/json", "close")
    assert json.loads(body)["error"]["message"] == ("the request line and headers did not arrive within 1 s "
                                                   "(--timeout-headers)")
    idle = _raw(d19, b"")  # connected, sent nothing: closed without an answer
    with idle:
        assert idle.recv(1) == b""
    kept = _raw(d19, b"GET /health HTTP/1.1\r\nHost: radianced\r\n\r\n")  # answered, then idle past keep-alive
    with kept:
        data = b""
        while chunk := kept.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200 OK") and data.endswith(b'{"status":"ready"}')


async def test_19_5_a_body_still_arriving_at_sigterm_gets_a_json_503_and_the_daemon_exits_0(tiny_model):
    d = start_daemon(tiny_model)
    try:
        sock = _raw(d, _post_head(100).replace(f"Authorization: Bearer {KEY}\r\n".encode(), b"") + b'{"prompt":')
        await asyncio.sleep(0.5)  # the request is reading its body
        d.proc.send_signal(signal.SIGTERM)
        status, headers, body = _answer(sock)
        assert d.stop(timeout=10) == 0
    finally:
        d.stop(signal.SIGKILL)
    assert (status, headers["content-type"], headers["connection"]) == (503, "application/json", "close")
    assert json.loads(body)["error"] == {
        "message": "the server began shutting down while this request's body was arriving; the request was not run: "
                   "send it again (to another server, or once this one is back)",
        "type": "service_unavailable", "param": None, "code": None}
    assert "POST /v1/completions 503" in d.log() and "Exception in ASGI application" not in d.log()


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


async def test_19_6_the_api_key_comes_from_a_file_or_the_environment_never_the_command_line(
        d19, key_file, daemon, tiny_model):
    assert KEY not in _cmdline(d19.pid) and key_file in _cmdline(d19.pid)
    async with httpx.AsyncClient(base_url=d19.url, timeout=60) as c:
        r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert error(r) == (401, None, "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                                       "with the daemon's key")
    async with api(d19) as c:
        assert (await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})).status_code == 200
    assert "--api-key on the command line" not in d19.log()
    assert "WARNING radianced: --api-key on the command line is readable by every local user" in daemon.log()

    d = start_daemon(tiny_model, env={"RADIANCED_API_KEY": KEY})
    try:
        assert KEY not in _cmdline(d.pid)
        async with api(d) as c:
            assert (await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})).status_code == 200
        async with httpx.AsyncClient(base_url=d.url) as c:
            assert (await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})).status_code == 401
        assert d.stop() == 0
    finally:
        d.stop(signal.SIGKILL)

    both = subprocess.run([sys.executable, "-m", "radianced.cli", "--model", str(tiny_model), "--port", "0",
                           "--api-key-file", key_file], env={**os.environ, "RADIANCED_API_KEY": KEY},
                          capture_output=True, text=True, timeout=60)
    assert both.returncode == 1 and ("ERROR radianced: cannot start: the API key is given by both --api-key-file "
                                     "and $RADIANCED_API_KEY: give it one way") in both.stderr


async def test_19_8_a_burst_is_admitted_up_to_the_free_slots_plus_max_queue(d19):
    """60 streams at once against --max-num-seqs 8 --max-queue 16 were answered 16 x 200 and 44 x 429:
    the queue was counted before any request had a slot. 8 run + 16 wait = 24 now."""
    body = {"prompt": PROMPT_IDS, "max_tokens": 240, "ignore_eos": True, "stream": True}
    async with api(d19, limits=httpx.Limits(max_connections=64)) as c:
        responses = await asyncio.gather(*(c.send(c.build_request("POST", "/v1/completions", json=body),
                                                  stream=True) for _ in range(60)))
        statuses = [r.status_code for r in responses]
        refusals = [json.loads(await r.aread())["error"] for r in responses if r.status_code == 429]
        for r in responses:
            await r.aclose()
    # 24 exactly unless a stream ended before the burst did (its slot then takes one more)
    assert set(statuses) == {200, 429} and statuses.count(200) >= 24, statuses
    assert all(e == {"message": "16 requests are waiting (--max-queue 16); retry later", "type": "rate_limit_error",
                     "param": None, "code": None} for e in refusals), refusals


@pytest.mark.parametrize("path, body, content_type, answer", [
    ("/v1/completions", {"prompt": "Hi", "top_k": 2**63}, "application/json",
     (400, "top_k", f"top_k must be at most the vocabulary size (400), or 0 / -1 to disable it, got {2**63}")),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "application/json",
     (400, "messages[0].content", "messages[0].content is required (a string or a list of text parts); null goes "
                                  "only beside tool_calls, which are not supported")),
    ("/v1/completions", '{"prompt": "Hi", "stop": ["\\ud800"]}', "application/json",
     (400, None, "the request body is not valid JSON (a string holds the lone UTF-16 surrogate \\ud800 at byte 27, "
                 "which is not a character; write the character itself, or a high and low surrogate pair)")),
    ("/v1/completions", {"prompt": "Hi"}, "text/plain",
     (415, None, "Content-Type 'text/plain': the body must be JSON; send the header 'Content-Type: "
                 "application/json' (or none)")),
    ("/v1/completions", {"prompt": "Hi"}, "application/x-www-form-urlencoded",
     (415, None, "Content-Type 'application/x-www-form-urlencoded': the body must be JSON; send the header "
                 "'Content-Type: application/json' (or none)")),
])
async def test_19_9_small_issues_are_400s_naming_the_field(d19, path, body, content_type, answer):
    content = body if isinstance(body, str) else json.dumps(body)
    async with api(d19) as c:
        r = await c.post(path, content=content, headers={"Content-Type": content_type})
    assert error(r) == answer


async def test_19_9_json_without_a_content_type_or_with_a_charset_is_accepted(d19):
    async with api(d19) as c:
        bare = await c.post("/v1/completions", content=json.dumps({"prompt": "Hi", "max_tokens": 1}))
        charset = await c.post("/v1/completions", content=json.dumps({"prompt": "Hi", "max_tokens": 1}),
                               headers={"Content-Type": "application/json; charset=utf-8"})
    assert "content-type" not in bare.request.headers
    assert bare.status_code == charset.status_code == 200
