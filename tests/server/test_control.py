"""The control socket served in-process with fake handlers: permissions, round trips, and
every kind of bad line answered with an error reply on a connection that keeps working."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import tempfile

import msgspec
import pytest

from radianced.server import control
from radianced.server.control import (CancelArgs, CancelResult, ControlError, ControlSocketError, DaemonUnreachable,
                                      DrainResult, ReceiptResult, RequestSummary, StatusResult)

STATUS = StatusResult(
    uptime_s=3723.5, state="ready", model="smollm2-135m", receipt=["placement: resident", "card: 80.00 MiB total"],
    kv_util=0.375, running=1, waiting=1, steps=812,
    requests=[RequestSummary(id="cmpl-a1", state="running", prompt_tokens=12, generated=40, age_s=2.25),
              RequestSummary(id="cmpl-b2", state="waiting", prompt_tokens=7, generated=0, age_s=0.5)])


class FakeDaemon:
    """The handlers a daemon passes: sync and async ones, Structs and plain dicts."""

    def __init__(self):
        self.draining = False
        self.in_flight = {"cmpl-a1", "cmpl-b2"}

    def handlers(self):
        return {"status": self.status, "receipt": self.receipt, "drain": self.drain, "cancel": self.cancel,
                "boom": self.boom, "refuse": self.refuse}

    def status(self, args):
        return STATUS

    async def receipt(self, args):
        await asyncio.sleep(0)
        return {"lines": STATUS.receipt}

    def drain(self, args):
        self.draining = True
        return DrainResult(draining=True)

    async def cancel(self, args):
        request_id = msgspec.convert(args, CancelArgs).id
        found = request_id in self.in_flight
        self.in_flight.discard(request_id)
        return CancelResult(cancelled=found)

    def boom(self, args):
        raise RuntimeError("engine step failed")

    def refuse(self, args):
        raise ControlError("not while loading")


@pytest.fixture
def sock_dir():
    """A short directory: tmp_path can exceed the 107-byte limit of a Unix socket path."""
    with tempfile.TemporaryDirectory(prefix="rc-") as d:
        yield d


@pytest.fixture
async def served(sock_dir):
    daemon = FakeDaemon()
    path = os.path.join(sock_dir, "control.sock")
    server = await control.serve(path, daemon.handlers())
    yield path, daemon
    server.close()
    await server.wait_closed()


class Conn:
    """One raw client connection: send bytes, read one reply decoded to plain JSON."""

    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer

    async def ask(self, line: bytes):
        self.writer.write(line + b"\n")
        await self.writer.drain()
        return msgspec.json.decode(await asyncio.wait_for(self.reader.readline(), 5))

    async def cmd(self, cmd, args=None, v=1):
        return await self.ask(msgspec.json.encode({"v": v, "cmd": cmd, "args": args or {}}))


@pytest.fixture
async def conn(served):
    reader, writer = await asyncio.open_unix_connection(served[0])
    yield Conn(reader, writer)
    writer.close()


# -- the socket file --------------------------------------------------------------


async def test_socket_is_owner_only_in_a_created_0700_directory(sock_dir):
    path = os.path.join(sock_dir, "run", "control.sock")
    server = await control.serve(path, {})
    try:
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    finally:
        server.close()
        await server.wait_closed()


async def test_stale_socket_file_is_replaced(sock_dir):
    path = os.path.join(sock_dir, "control.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)  # bound, never listening: what a killed daemon leaves behind
    stale.close()
    server = await control.serve(path, {"status": lambda args: {"up": True}})
    try:
        assert await control.request(path, "status") == {"up": True}
    finally:
        server.close()
        await server.wait_closed()


async def test_a_live_daemon_is_not_replaced(served):
    path, _ = served
    with pytest.raises(ControlSocketError, match="another radianced is listening there"):
        await control.serve(path, {})
    assert await control.request(path, "drain") == {"draining": True}


async def test_a_regular_file_at_the_path_is_not_removed(sock_dir):
    path = os.path.join(sock_dir, "control.sock")
    with open(path, "w") as f:
        f.write("mine")
    with pytest.raises(ControlSocketError, match="exists and is not a socket"):
        await control.serve(path, {})
    assert open(path).read() == "mine"


async def test_too_long_path_names_the_flag_and_the_limit(sock_dir):
    path = os.path.join(sock_dir, "x" * 120 + ".sock")
    with pytest.raises(ControlSocketError) as e:
        await control.serve(path, {})
    assert str(e.value).startswith(f"--control-socket {path}: cannot bind: ")
    assert str(e.value).endswith("is longer than a Unix socket path may be (107)")


def test_default_path_follows_systemd_runtime_directory(monkeypatch):
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/radianced")
    assert control.default_socket_path() == "/run/radianced/control.sock"
    monkeypatch.delenv("RUNTIME_DIRECTORY")
    assert control.default_socket_path() == f"/tmp/radianced-{os.getuid()}/control.sock"


# -- round trips --------------------------------------------------------------------


async def test_status_round_trip(conn):
    assert await conn.cmd("status") == {"v": 1, "ok": True, "result": msgspec.to_builtins(STATUS)}


async def test_receipt_drain_cancel_round_trips_on_one_connection(conn, served):
    _, daemon = served
    assert await conn.cmd("receipt") == {"v": 1, "ok": True,
                                         "result": {"lines": ["placement: resident", "card: 80.00 MiB total"]}}
    assert await conn.cmd("drain") == {"v": 1, "ok": True, "result": {"draining": True}}
    assert daemon.draining
    assert await conn.cmd("cancel", {"id": "cmpl-a1"}) == {"v": 1, "ok": True, "result": {"cancelled": True}}
    assert await conn.cmd("cancel", {"id": "cmpl-a1"}) == {"v": 1, "ok": True, "result": {"cancelled": False}}
    assert daemon.in_flight == {"cmpl-b2"}


async def test_client_decodes_into_the_shared_structs(served):
    path, _ = served
    assert msgspec.convert(await control.request(path, "status"), StatusResult) == STATUS
    assert msgspec.convert(await control.request(path, "receipt"), ReceiptResult) == ReceiptResult(
        lines=STATUS.receipt)
    assert await asyncio.to_thread(control.call, path, "cancel", {"id": "cmpl-b2"}) == {"cancelled": True}


# -- bad lines: an error reply, and the connection keeps answering ------------------------


async def test_unknown_command_gets_an_error_and_the_connection_still_answers(conn):
    assert await conn.cmd("reboot") == {
        "v": 1, "ok": False,
        "error": "unknown command 'reboot'; this daemon knows boom, cancel, drain, receipt, refuse, status"}
    assert await conn.cmd("drain") == {"v": 1, "ok": True, "result": {"draining": True}}


async def test_malformed_json_gets_an_error(conn):
    assert await conn.ask(b'{"v": 1, "cmd"') == {"v": 1, "ok": False,
                                                 "error": "not a JSON request line: Input data was truncated"}
    assert await conn.ask(b"[1, 2]") == {"v": 1, "ok": False,
                                        "error": 'a request is a JSON object: {"v": 1, "cmd": ..., "args": {...}}'}
    assert await conn.ask(b'{"v": 1, "cmd": 3}') == {"v": 1, "ok": False,
                                                    "error": "bad request: Expected `str`, got `int` - at `$.cmd`"}
    assert (await conn.cmd("status"))["ok"] is True


async def test_wrong_version_gets_an_error(conn):
    assert await conn.cmd("status", v=2) == {"v": 1, "ok": False,
                                             "error": "protocol version 2 not supported; this daemon speaks v1"}
    assert await conn.ask(b'{"cmd": "status"}') == {
        "v": 1, "ok": False, "error": "protocol version None not supported; this daemon speaks v1"}
    assert (await conn.cmd("status"))["ok"] is True


async def test_handler_exceptions_become_error_replies(conn, caplog):
    assert await conn.cmd("boom") == {"v": 1, "ok": False, "error": "boom failed: RuntimeError: engine step failed"}
    assert "control command 'boom' failed" in caplog.text  # logged with its traceback for the operator
    assert await conn.cmd("refuse") == {"v": 1, "ok": False, "error": "not while loading"}
    assert await conn.cmd("cancel") == {"v": 1, "ok": False,
                                        "error": "cancel: bad args: Object missing required field `id`"}
    assert (await conn.cmd("status"))["ok"] is True


async def test_unencodable_result_is_an_error_reply_not_a_dropped_connection(sock_dir):
    path = os.path.join(sock_dir, "control.sock")
    server = await control.serve(path, {"odd": lambda args: {"x": object()}, "ok": lambda args: {}})
    try:
        reader, writer = await asyncio.open_unix_connection(path)
        c = Conn(reader, writer)
        assert await c.cmd("odd") == {"v": 1, "ok": False,
                                      "error": "odd failed: TypeError: Encoding objects of type object is unsupported"}
        assert await c.cmd("ok") == {"v": 1, "ok": True, "result": {}}
        writer.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_over_long_line_is_skipped_whole_and_the_next_request_is_answered(conn):
    line = b'{"v": 1, "cmd": "status", "args": {"pad": "' + b"x" * (2 * control.MAX_LINE) + b'"}}'
    assert await conn.ask(line) == {"v": 1, "ok": False,
                                    "error": f"request line longer than {control.MAX_LINE} bytes"}
    assert await conn.cmd("receipt") == {"v": 1, "ok": True, "result": {"lines": STATUS.receipt}}


async def test_blank_lines_are_ignored(conn):
    conn.writer.write(b"\n\n")
    assert await conn.cmd("drain") == {"v": 1, "ok": True, "result": {"draining": True}}


async def test_requests_on_one_write_get_replies_in_order(conn):
    conn.writer.write(b'{"v": 1, "cmd": "drain"}\n{"v": 1, "cmd": "nope"}\n')
    first = msgspec.json.decode(await conn.reader.readline())
    second = msgspec.json.decode(await conn.reader.readline())
    assert first == {"v": 1, "ok": True, "result": {"draining": True}}
    assert second["ok"] is False and second["error"].startswith("unknown command 'nope'")


# -- client errors -----------------------------------------------------------------------


async def test_client_raises_the_daemons_error_message(served):
    with pytest.raises(ControlError, match="^not while loading$"):
        await control.request(served[0], "refuse")


async def test_client_says_which_path_has_no_daemon(sock_dir):
    path = os.path.join(sock_dir, "none.sock")
    with pytest.raises(DaemonUnreachable) as e:
        await control.request(path, "status")
    assert str(e.value) == f"cannot reach radianced at {path}: no socket there"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()
    with pytest.raises(DaemonUnreachable) as e:
        await control.request(path, "status")
    assert str(e.value) == f"cannot reach radianced at {path}: nothing listening (a stale socket)"


async def test_client_times_out_on_a_daemon_that_never_answers(sock_dir):
    path = os.path.join(sock_dir, "control.sock")
    released = asyncio.Event()
    server = await control.serve(path, {"hang": lambda args: released.wait()})
    try:
        with pytest.raises(DaemonUnreachable) as e:
            await control.request(path, "hang", timeout=0.1)
        assert str(e.value) == f"cannot reach radianced at {path}: no reply to 'hang' within 0.1 s"
    finally:
        released.set()
        server.close()
        await server.wait_closed()
