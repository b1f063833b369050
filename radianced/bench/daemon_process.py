"""`bench run --start -- <radianced args>`: the daemon as a child process for the length of the run.

It listens on a port the kernel picks (unless the arguments name one) and
keeps its control socket in a private folder (unless given), so a bench never
collides with a daemon already running on the machine. Its log goes to a file
whose tail is shown when it fails to start.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from radianced.config import Config, ConfigError, add_flags

STARTUP_TIMEOUT_S = 600.0  # a large model converts, loads and captures graphs before /health says 200
STOP_TIMEOUT_S = 60.0
_LISTENING = re.compile(r"serving HTTP on (http://\S+)")


class DaemonStartError(RuntimeError):
    """The child exited or never became ready; the message carries its log's tail."""


def daemon_config(args: list[str]) -> Config:
    """The Config the daemon will build from `args` (the bench reads its limits from it)."""
    parser = argparse.ArgumentParser(prog="radianced", add_help=False)
    add_flags(parser)
    try:
        return Config.from_args(parser.parse_args(args))
    except SystemExit:
        raise ConfigError(f"radianced would refuse these arguments: {' '.join(args)}") from None


def tree_rss_mib(proc) -> float:
    """The RSS of `proc` (a psutil.Process) and its children, MiB: a daemon's with its HTTP front's (and
    --tp's ranks')."""
    return sum(p.memory_info().rss for p in (proc, *proc.children())) / 2**20


@dataclass
class ChildDaemon:
    """A radianced started by the bench."""

    proc: subprocess.Popen
    url: str
    log_path: Path

    @staticmethod
    def start(args: list[str], timeout_s: float = STARTUP_TIMEOUT_S) -> ChildDaemon:
        """Run `python -m radianced.cli ARGS` and wait until /health answers 200; DaemonStartError otherwise."""
        workdir = Path(tempfile.mkdtemp(prefix="radiance-bench-"))
        extra = []
        if "--port" not in args and "--http-socket" not in args:
            extra += ["--port", "0"]
        if "--control-socket" not in args:
            extra += ["--control-socket", str(workdir / "control.sock")]
        log_path = workdir / "daemon.log"
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "radianced.cli", *args, *extra], stdout=log,
                                    stderr=subprocess.STDOUT, env=env, cwd=workdir)
        child = ChildDaemon(proc, "", log_path)
        child._wait_ready(time.monotonic() + timeout_s)
        return child

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _fail(self, why: str) -> DaemonStartError:
        self.stop()
        return DaemonStartError(f"the daemon {why} (exit {self.proc.returncode}); its log ends:\n{self.log()[-3000:]}")

    def _wait_ready(self, deadline: float) -> None:
        while not self.url:
            m = _LISTENING.search(self.log())
            if m:
                self.url = m[1]
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                raise self._fail("never listened on HTTP (the bench needs TCP: no --http-socket)")
            else:
                time.sleep(0.1)
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise self._fail("never became ready")
            time.sleep(0.1)

    def stop(self) -> int:
        """SIGTERM (the daemon drains and exits); SIGKILL after STOP_TIMEOUT_S. Its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
