"""The daemon's life: sd_notify, the drain on SIGTERM and `radiancectl drain`, the control
socket, a fatal engine error, start-up failures. Each stopping test starts its own daemon."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import httpx

from radianced.server import control
from tests.server.conftest import SERVED_NAME, start_daemon
from tests.server.test_http import PROMPT_IDS

STREAM = {"prompt": PROMPT_IDS, "max_tokens": 100, "ignore_eos": True, "stream": True,
          "stream_options": {"include_usage": True}}


def finish_reason(events) -> str:
    return [e for e in events if isinstance(e, dict) and e.get("choices")][-1]["choices"][0]["finish_reason"]


def completion_tokens(events) -> int:
    return events[-2]["usage"]["completion_tokens"]


class NotifySocket:
    """A stand-in for systemd's NOTIFY_SOCKET: collects the datagrams the daemon sends."""

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.messages: list[str] = []
        self._thread = threading.Thread(target=self._collect, daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        while True:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except OSError:
                return

    def fields(self) -> list[str]:
        """Every KEY=VALUE line received, in order."""
        return [line for m in list(self.messages) for line in m.split("\n")]

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


async def _stream(c: httpx.AsyncClient, started: asyncio.Event | None = None, body=STREAM) -> list[dict | str]:
    """The SSE events of one request (JSON chunks, then "[DONE]"); sets `started` at the first."""
    events = []
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                if started is not None:
                    started.set()
    return events


async def _until_draining(c: httpx.AsyncClient) -> None:
    while (r := await c.get("/health")).status_code == 200:
        await asyncio.sleep(0.01)
    assert r.status_code == 503 and r.json() == {"status": "draining"}


async def test_sigterm_lets_eight_streams_finish_refuses_new_requests_and_exits_0(tiny_model, sock_dir):
    notify = NotifySocket(os.path.join(sock_dir, "notify"))
    # streams long enough to outlast the polling below on a fast, quiet machine (100 tokens once finished
    # within the first poll, and the daemon had exited before /health could say "draining")
    d = start_daemon(tiny_model, "--drain-timeout", "30", "--max-model-len", "2048",
                     env={"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "200000"})
    long = {**STREAM, "max_tokens": 1500}
    try:
        async with httpx.AsyncClient(base_url=d.url, timeout=60) as c:
            started = [asyncio.Event() for _ in range(8)]
            streams = [asyncio.create_task(_stream(c, s, long)) for s in started]
            await asyncio.gather(*(s.wait() for s in started))
            await asyncio.sleep(0.3)  # a few watchdog periods while the engine works
            d.proc.send_signal(signal.SIGTERM)
            await _until_draining(c)
            late = await c.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
            assert late.status_code == 503 and "draining" in late.json()["error"]["message"]
            results = await asyncio.gather(*streams)
        assert d.stop(timeout=30) == 0
    finally:
        d.stop(signal.SIGKILL)
        notify.close()
    for events in results:
        assert events[-1] == "[DONE]" and finish_reason(events) == "length" and completion_tokens(events) == 1500
    fields = notify.fields()
    assert fields.index("READY=1") > min(i for i, f in enumerate(fields) if f.startswith("EXTEND_TIMEOUT_USEC="))
    watchdogs = [i for i, f in enumerate(fields) if f == "WATCHDOG=1"]
    assert len(watchdogs) >= 3 and fields.index("STOPPING=1") > fields.index("READY=1")
    assert any(i > fields.index("READY=1") for i in watchdogs)
    assert "SIGTERM: draining" in d.log() and "exiting with status 0" in d.log()


def test_sigterm_after_sigterm_until_the_process_ends_still_exits_0(tiny_model):
    """A shell's process-group kill or `make` forwarding repeats SIGTERM; one that lands after the
    loop has closed (its handlers gone) had killed the process: status -15 in CI."""
    d = start_daemon(tiny_model)
    try:
        signals = 0
        while d.proc.poll() is None:
            d.proc.send_signal(signal.SIGTERM)
            signals += 1
            time.sleep(0.002)
        assert d.proc.wait() == 0 and signals > 1
    finally:
        d.stop(signal.SIGKILL)
    assert "already draining" in d.log() and "exiting with status 0" in d.log()


async def test_radiancectl_drain_past_the_drain_timeout_aborts_streams_cleanly_over_the_unix_socket(
        tiny_model, sock_dir):
    http_socket = os.path.join(sock_dir, "http.sock")
    d = start_daemon(tiny_model, "--http-socket", http_socket, "--drain-timeout", "0")
    try:
        assert stat.S_IMODE(os.stat(d.control_socket).st_mode) == 0o600
        transport = httpx.AsyncHTTPTransport(uds=http_socket)
        body = {**STREAM, "max_tokens": 240}
        async with httpx.AsyncClient(base_url="http://radianced", transport=transport, timeout=60) as c:
            started = [asyncio.Event() for _ in range(2)]
            streams = [asyncio.create_task(_stream(c, s, body)) for s in started]
            await asyncio.gather(*(s.wait() for s in started))
            assert await control.request(d.control_socket, "drain") == {"draining": True}
            results = await asyncio.gather(*streams)
        assert d.stop(timeout=30) == 0
    finally:
        d.stop(signal.SIGKILL)
    for events in results:
        assert events[-1] == "[DONE]" and finish_reason(events) == "abort" and completion_tokens(events) < 240
    assert "radiancectl drain: draining" in d.log()
    assert not os.path.exists(http_socket) and not os.path.exists(d.control_socket)


async def test_control_socket_reports_and_cancels_a_live_request(daemon):
    assert stat.S_IMODE(os.stat(daemon.control_socket).st_mode) == 0o600
    async with httpx.AsyncClient(base_url=daemon.url, headers=daemon.headers(), timeout=60) as c:
        async with c.stream("POST", "/v1/completions", json={**STREAM, "max_tokens": 240}) as r:
            rid = r.headers["x-request-id"]
            lines = r.aiter_lines()
            first = await lines.__anext__()
            status = await control.request(daemon.control_socket, "status")
            assert status["state"] == "ready" and status["model"] == SERVED_NAME
            assert [(q["id"], q["state"], q["prompt_tokens"]) for q in status["requests"]] == \
                [(rid, "running", len(PROMPT_IDS))]
            assert status["running"] == 1 and status["kv_util"] > 0 and status["steps"] > 0
            receipt = await control.request(daemon.control_socket, "receipt")
            assert receipt["lines"] == status["receipt"] and receipt["lines"][0].startswith("placement: ")
            assert await control.request(daemon.control_socket, "cancel", {"id": f"cmpl-{rid}"}) == \
                {"cancelled": True}
            rest = [first] + [line async for line in lines]
    events = [line[6:] for line in rest if line.startswith("data: ")]
    events = [json.loads(e) for e in events[:-1]] + [events[-1]]
    assert events[-1] == "[DONE]" and finish_reason(events) == "abort" and completion_tokens(events) < 240
    assert await control.request(daemon.control_socket, "cancel", {"id": rid}) == {"cancelled": False}
    out = subprocess.run([sys.executable, "-m", "radianced.ctl", "status",  # the checkout's, installed or not
                          "--control-socket", daemon.control_socket], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "ready" in out.stdout and SERVED_NAME in out.stdout


FAULT = """
import radianced.engine.runner as runner
import radianced.engine.warmup as warmup
_launch, _served, _calls, _warm = runner.Runner.launch, warmup.warm_up_served, [0], [True]
async def warm_up_served(*args, **kwargs):  # start-up's warm-up steps launch too: count from its end
    await _served(*args, **kwargs)
    _warm[0] = False
def launch(self, plan):
    _calls[0] += not _warm[0]
    if _calls[0] > 4:  # a few steps into the test's two requests (50 tokens each)
        raise RuntimeError("injected step fault")
    return _launch(self, plan)
runner.Runner.launch = launch
warmup.warm_up_served = warm_up_served
"""


async def test_a_fatal_engine_error_fails_live_requests_and_exits_1(tiny_model):
    d = start_daemon(tiny_model, python_code=FAULT)
    try:
        async with httpx.AsyncClient(base_url=d.url, timeout=60) as c:
            plain, streamed = await asyncio.gather(
                c.post("/v1/completions", json={"prompt": PROMPT_IDS, "max_tokens": 50, "ignore_eos": True}),
                _stream(c))
        assert d.stop(timeout=30) == 1
    finally:
        d.stop(signal.SIGKILL)
    assert plain.status_code == 500 and "injected step fault" in plain.json()["error"]["message"]
    assert streamed[-1] == "[DONE]" and streamed[-2]["error"]["type"] == "server_error"
    log = d.log()
    assert "CRITICAL radianced: the engine failed; exiting" in log and "exiting with status 1" in log


def test_start_up_failures_exit_1_with_one_line_saying_why(tiny_model, tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        out = subprocess.run([sys.executable, "-m", "radianced.cli", "--model", str(tiny_model), "--port", port],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and re.search(r"ERROR radianced: cannot serve HTTP: \[Errno 98\]", out.stderr)
    missing = tmp_path / "missing.rad"
    d = start_daemon(missing, wait_ready=False)
    assert d.proc.wait(60) == 1
    assert "ERROR radianced: cannot start: " in d.log() and str(missing) in d.log()
    assert "Traceback" not in d.log()


SLOW_LOAD = """
import time
from radianced.engine.engine import Engine
_build = Engine.build.__func__
def build(cls, *args, **kwargs):
    time.sleep(30)
    return _build(cls, *args, **kwargs)
Engine.build = classmethod(build)
"""


async def test_while_loading_health_and_requests_get_503_and_a_stop_exits_0_at_once(tiny_model):
    d = start_daemon(tiny_model, python_code=SLOW_LOAD, wait_ready=False)
    try:
        async with httpx.AsyncClient(base_url=d.url, timeout=10) as c:
            health = await c.get("/health")
            request = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        status = await control.request(d.control_socket, "status")
        assert d.stop(timeout=10) == 0  # the 30 s load is not waited for
    finally:
        d.stop(signal.SIGKILL)
    assert health.status_code == 503 and health.json() == {"status": "loading"}
    assert request.status_code == 503 and "still loading" in request.json()["error"]["message"]
    assert status["state"] == "loading" and status["receipt"] == [] and status["requests"] == []
    assert "stopped while loading" in d.log() and "ready:" not in d.log()
