"""radiancectl status / drain / cancel against a control socket served in this test's loop
(the ctl runs in a thread, as it would in its own process), and its exit codes."""

from __future__ import annotations

import asyncio
import os
import tempfile

import pytest

from radianced import ctl
from radianced.server import control
from radianced.server.control import CancelResult, ControlError, DrainResult, RequestSummary, StatusResult

STATUS = StatusResult(
    uptime_s=3723.5, state="ready", model="smollm2-135m-instruct",
    receipt=["placement: resident (every weight on the card)", "kv pool: 2048 tokens [16 blocks]"],
    kv_util=0.375, running=1, waiting=1, steps=812,
    requests=[RequestSummary(id="cmpl-a1", state="running", prompt_tokens=12, generated=40, age_s=2.5),
              RequestSummary(id="cmpl-b2", state="waiting", prompt_tokens=7, generated=0, age_s=75.0)])


@pytest.fixture
def sock_dir():
    """A short directory: tmp_path can exceed the 107-byte limit of a Unix socket path."""
    with tempfile.TemporaryDirectory(prefix="rc-") as d:
        yield d


@pytest.fixture
async def daemon(sock_dir, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # rich's width when stdout is not a terminal
    calls = []

    def cancel(args):
        calls.append(("cancel", args))
        return CancelResult(cancelled=args["id"] == "cmpl-a1")

    def drain(args):
        calls.append(("drain", args))
        return DrainResult(draining=True)

    def status(args):
        if calls and calls[-1] == ("drain", {}):
            raise ControlError("status unavailable while the test says so")
        return STATUS

    path = os.path.join(sock_dir, "control.sock")
    server = await control.serve(path, {"status": status, "drain": drain, "cancel": cancel})
    yield path, calls
    server.close()
    await server.wait_closed()


async def ctl_main(*argv: str) -> int:
    """radiancectl in a thread, so this loop keeps serving the socket it talks to."""
    return await asyncio.to_thread(ctl.main, list(argv))


async def test_status_prints_the_table_with_the_values(daemon, capsys):
    path, _ = daemon
    assert await ctl_main("status", "--control-socket", path) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = [line.rstrip() for line in out.splitlines()]
    assert lines[:7] == ["state     ready",
                         "uptime    1h 02m 03s",
                         "model     smollm2-135m-instruct",
                         "kv util   37.5%",
                         "requests  1 running, 1 waiting",
                         "steps     812",
                         "requests"]
    rows = [line.replace("┃", "│").split("│")[1:-1] for line in lines if line.startswith(("┃", "│"))]
    assert [[cell.strip() for cell in row] for row in rows] == [
        ["id", "state", "prompt", "generated", "age"],
        ["cmpl-a1", "running", "12", "40", "2.5 s"],
        ["cmpl-b2", "waiting", "7", "0", "1m 15s"]]
    # receipt lines verbatim: their brackets are text, not rich markup
    assert lines[-3:] == ["receipt",
                          "  placement: resident (every weight on the card)",
                          "  kv pool: 2048 tokens [16 blocks]"]


async def test_status_json_prints_the_reply(daemon, capsys):
    import msgspec

    assert await ctl_main("status", "--json", "--control-socket", daemon[0]) == 0
    assert msgspec.json.decode(capsys.readouterr().out, type=StatusResult) == STATUS


async def test_drain_and_cancel(daemon, capsys):
    path, calls = daemon
    assert await ctl_main("drain", "--control-socket", path) == 0
    assert capsys.readouterr().out == "draining: new requests get 503; requests in flight finish\n"
    assert await ctl_main("cancel", "cmpl-a1", "--control-socket", path) == 0
    assert capsys.readouterr().out == "cancelled cmpl-a1\n"
    assert await ctl_main("cancel", "cmpl-zz", "--control-socket", path) == 1
    assert capsys.readouterr().err == ("radiancectl cancel: no request 'cmpl-zz' in flight "
                                       "(finished already, or a wrong id)\n")
    assert calls == [("drain", {}), ("cancel", {"id": "cmpl-a1"}), ("cancel", {"id": "cmpl-zz"})]


async def test_daemon_error_reply_exits_1(daemon, capsys):
    path, _ = daemon
    assert await ctl_main("drain", "--control-socket", path) == 0
    capsys.readouterr()
    assert await ctl_main("status", "--control-socket", path) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "radiancectl status: the daemon refused: status unavailable while the test says so\n"


def test_nothing_listening_exits_2_naming_the_path(sock_dir, capsys):
    path = os.path.join(sock_dir, "control.sock")
    assert ctl.main(["status", "--control-socket", path]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (f"radiancectl status: cannot reach radianced at {path}: no socket there\n"
                   "  tried --control-socket; the daemon may not be running, "
                   "or it listens elsewhere: pass --control-socket PATH\n")


def test_default_path_is_the_daemons_default(sock_dir, monkeypatch, capsys):
    monkeypatch.setenv("RUNTIME_DIRECTORY", sock_dir)
    assert ctl.main(["drain"]) == 2
    assert capsys.readouterr().err == (
        f"radiancectl drain: cannot reach radianced at {sock_dir}/control.sock: no socket there\n"
        "  tried the default path (no --control-socket given); the daemon may not be running, "
        "or it listens elsewhere: pass --control-socket PATH\n")


async def test_default_path_reaches_a_daemon_on_it(sock_dir, monkeypatch, capsys):
    monkeypatch.setenv("RUNTIME_DIRECTORY", sock_dir)
    server = await control.serve(control.default_socket_path(), {"drain": lambda args: {"draining": True}})
    try:
        assert await ctl_main("drain") == 0
        assert capsys.readouterr().out == "draining: new requests get 503; requests in flight finish\n"
    finally:
        server.close()
        await server.wait_closed()


async def test_status_of_an_idle_loading_daemon_says_so(sock_dir, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "100")
    idle = StatusResult(uptime_s=4.0, state="loading", model="m", receipt=[], kv_util=0.0,
                        running=0, waiting=0, requests=[], steps=0)
    path = os.path.join(sock_dir, "control.sock")
    server = await control.serve(path, {"status": lambda args: idle})
    try:
        assert await ctl_main("status", "--control-socket", path) == 0
    finally:
        server.close()
        await server.wait_closed()
    assert [line.rstrip() for line in capsys.readouterr().out.splitlines()] == [
        "state     loading", "uptime    4.0 s", "model     m", "kv util   0.0%",
        "requests  0 running, 0 waiting", "steps     0", "requests: none in flight"]
