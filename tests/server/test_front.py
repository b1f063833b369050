"""The HTTP front process (server/front.py) of a real daemon: a process of its own without torch;
it ignores SIGINT (the daemon owns the drain) and exits with the daemon; if it dies, the daemon says
so and exits 1; if the daemon dies, it exits too. /health says when the daemon's loop stops answering,
and a front that stops answering does not hold the daemon's stop."""

from __future__ import annotations

import signal
import time

import psutil

from tests.server.conftest import client, start_daemon


def _front(d) -> psutil.Process:
    (front,) = [p for p in psutil.Process(d.pid).children() if "radianced.server.front" in " ".join(p.cmdline())]
    return front


def _health(d) -> int:
    with client(d) as c:
        return c.get("/health").status_code


def test_the_front_is_its_own_process_without_torch_ignores_sigint_and_its_death_stops_the_daemon(tiny_model):
    d = start_daemon(tiny_model)
    front = _front(d)
    maps = open(f"/proc/{front.pid}/maps").read()
    assert "libtorch" not in maps and "libtorch" in open(f"/proc/{d.pid}/maps").read()
    front.send_signal(signal.SIGINT)
    time.sleep(0.3)
    assert front.is_running() and _health(d) == 200
    front.kill()
    assert d.proc.wait(30) == 1
    log = d.log()
    assert "the HTTP front process ended" in log and "; stopping" in log and "status -9" in log
    assert "exiting with status 1" in log


def test_the_front_exits_with_the_daemon_asked_or_not(tiny_model):
    d = start_daemon(tiny_model)
    front = _front(d)
    assert d.stop(signal.SIGINT) == 0
    front.wait(10)  # not our child: its status is the daemon's to read, which says only a failure
    assert not front.is_running() and "the HTTP front exited with status" not in d.log()
    d = start_daemon(tiny_model)
    front = _front(d)
    d.proc.kill()
    d.proc.wait(10)
    front.wait(10)
    assert not front.is_running()
    assert "the daemon's process ended: the HTTP front exits" in d.log_with("the HTTP front exits")


def test_health_says_when_the_daemons_loop_does_not_answer_and_a_stuck_front_does_not_hold_the_stop(tiny_model):
    d = start_daemon(tiny_model, "--drain-timeout", "1")
    front = _front(d)
    d.proc.send_signal(signal.SIGSTOP)
    try:
        with client(d) as c:
            r = c.get("/health")
    finally:
        d.proc.send_signal(signal.SIGCONT)
    assert r.status_code == 503 and r.json() == {"status": "unresponsive"}
    assert _health(d) == 200
    front.suspend()
    t = time.monotonic()
    assert d.stop(timeout=20) == 0
    assert time.monotonic() - t < 10
    log = d.log()
    assert "did not take the phase 'draining'" in log and "the HTTP front exited with status -9" in log
