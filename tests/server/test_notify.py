"""sd_notify over a real AF_UNIX datagram socket: the bytes systemd would read, and silence outside systemd."""

from __future__ import annotations

import os
import socket
import tempfile

import pytest

from radianced.server import notify


@pytest.fixture
def listener(monkeypatch):
    """A datagram socket standing in for systemd's, with NOTIFY_SOCKET pointing at it.

    Under a short temp dir: tmp_path can exceed the 107-byte sun_path limit."""
    with tempfile.TemporaryDirectory(prefix="rn-") as d:
        path = os.path.join(d, "notify")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        sock.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        yield sock
        sock.close()


def test_each_helper_sends_its_message(listener):
    assert notify.ready()
    assert listener.recv(4096) == b"READY=1"
    assert notify.ready("serving smol")
    assert listener.recv(4096) == b"READY=1\nSTATUS=serving smol"
    assert notify.watchdog()
    assert listener.recv(4096) == b"WATCHDOG=1"
    assert notify.extend_timeout(30_000_000)
    assert listener.recv(4096) == b"EXTEND_TIMEOUT_USEC=30000000"
    assert notify.stopping("draining 3 requests")
    assert listener.recv(4096) == b"STOPPING=1\nSTATUS=draining 3 requests"
    assert notify.status("loading experts\n12/48")
    assert listener.recv(4096) == b"STATUS=loading experts 12/48"  # a newline would start a new field


def test_abstract_socket_name_with_at_sign(monkeypatch):
    name = f"radianced-test-{os.getpid()}-{id(monkeypatch)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify.notify(READY=1, MAINPID=42)
        assert sock.recv(4096) == b"READY=1\nMAINPID=42"


def test_without_notify_socket_every_call_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not notify.ready()
    assert not notify.watchdog()
    assert not notify.status("x")


def test_gone_socket_is_logged_not_raised(monkeypatch, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent-radianced/notify")
    assert not notify.watchdog()
    assert "sd_notify to /nonexistent-radianced/notify failed" in caplog.text
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    assert not notify.ready()
    assert "only Unix socket paths and @abstract names are supported" in caplog.text


@pytest.mark.parametrize("usec, pid, expected", [
    ("30000000", None, 30.0),
    ("30000000", "self", 30.0),
    ("30000000", "1", None),  # meant for another process (our parent)
    ("0", None, None),
    ("soon", None, None),
    (None, None, None),
])
def test_watchdog_interval_from_environment(monkeypatch, usec, pid, expected):
    for key, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", str(os.getpid()) if pid == "self" else pid)):
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    assert notify.watchdog_interval() == expected
