"""The daemon as a real subprocess on a tiny llama, for the HTTP and daemon tests.

`start_daemon(model, *flags)` runs `python -m radianced.cli` on port 0 (it logs
the port it got), one CPU thread, its own control socket, and waits for
/health 200. The session-wide `daemon` serves with --api-key API_KEY; the tests
that stop a daemon start their own.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from radianced.model.convert import convert
from radianced.model.tiny import make_tiny

API_KEY = "test-key-5f0c"
SERVED_NAME = "tiny-llama"
SMALL_NAME = "tiny-small"
MAX_MODEL_LEN = 256
CARD_MIB = 256  # 120 MiB of KV pages after the 96 MiB headroom and workspaces: plenty for the tiny llama
STARTUP_TIMEOUT_S = 60.0
_LISTENING = re.compile(r"serving HTTP on (http://\S+|unix:\S+)")


@dataclass
class Daemon:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT, or unix:PATH with --http-socket
    log_path: Path
    control_socket: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_with(self, *lines: str, timeout_s: float = 10.0) -> str:
        """The log once it holds every one of `lines` (or as it is after `timeout_s`): the daemon's INFO
        records are written by a thread of their own (server/log_writer.py), so a request's line may
        reach the file after its response reached the client."""
        deadline = time.monotonic() + timeout_s
        while not all(line in (log := self.log()) for line in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        return log

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the daemon and return its exit status (killed, and the test failed, past `timeout`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"the daemon did not exit within {timeout} s of signal {sig}:\n{self.log()[-3000:]}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    src = make_tiny("llama", tmp_path_factory.mktemp("tiny-llama"))
    convert(src, src / "model.rad")
    return src / "model.rad"


@pytest.fixture
def sock_dir():
    """A short directory: tmp_path can pass the 107-byte limit of a Unix socket path."""
    with tempfile.TemporaryDirectory(prefix="rd-") as d:
        yield d


def start_daemon(model: Path | None, *flags: str, env: dict[str, str] | None = None, wait_ready: bool = True,
                 python_code: str | None = None, timeout_s: float = STARTUP_TIMEOUT_S) -> Daemon:
    """Start `radianced --model MODEL FLAGS` on port 0; wait until it is ready (or only listening).

    model None serves the default model. --card-mib and --max-model-len default to
    the tiny model's CARD_MIB and MAX_MODEL_LEN unless `flags` set them.

    python_code, when given, runs in the child before the CLI (to patch a fault in). timeout_s bounds
    the wait (a GPU daemon compiles its kernels before it is ready).
    """
    workdir = Path(tempfile.mkdtemp(prefix="rd-"))
    atexit.register(shutil.rmtree, workdir, True)  # the log outlives stop(): tests read it after
    log_path = workdir / "daemon.log"
    control_socket = str(workdir / "control.sock")
    args = ["--control-socket", control_socket, *flags]
    if model is not None:
        args += ["--model", str(model)]
    if "--card-mib" not in flags:
        args += ["--card-mib", str(CARD_MIB)]
    if "--max-model-len" not in flags:
        args += ["--max-model-len", str(MAX_MODEL_LEN)]
    if "--http-socket" not in flags and "--port" not in flags:
        args += ["--port", "0"]
    child_env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    child_env.update({"RADIANCED_CPU_THREADS": "1", "OMP_NUM_THREADS": "1", **(env or {})})
    if python_code is None:
        cmd = [sys.executable, "-m", "radianced.cli", *args]
    else:
        cmd = [sys.executable, "-c", f"import sys\n{python_code}\nfrom radianced.cli import main\n"
                                     f"sys.exit(main(sys.argv[1:]))", *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env, cwd=workdir)
    d = Daemon(proc, "", log_path, control_socket)
    deadline = time.monotonic() + timeout_s
    while not d.url:
        m = _LISTENING.search(d.log())
        if m:
            d.url = m[1]
        elif proc.poll() is not None or time.monotonic() > deadline:
            d.stop(signal.SIGKILL, 5)
            raise RuntimeError(f"the daemon never listened (exit {proc.returncode}):\n{d.log()[-3000:]}")
        else:
            time.sleep(0.05)
    if wait_ready:
        wait_until_ready(d, deadline - time.monotonic())
    return d


def wait_until_ready(d: Daemon, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Wait for /health 200 (a daemon listens before it loads); killed, and RuntimeError, past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with client(d) as c:
                if c.get("/health").status_code == 200:
                    return
        except httpx.TransportError:
            pass
        if d.proc.poll() is not None or time.monotonic() > deadline:
            d.stop(signal.SIGKILL, 5)
            raise RuntimeError(f"the daemon never became ready (exit {d.proc.returncode}):\n{d.log()[-3000:]}")
        time.sleep(0.05)


def client(d: Daemon, **kwargs) -> httpx.Client:
    """An httpx client for the daemon's TCP or Unix socket."""
    if d.url.startswith("unix:"):
        return httpx.Client(base_url="http://radianced", transport=httpx.HTTPTransport(uds=d.url[5:]), **kwargs)
    return httpx.Client(base_url=d.url, **kwargs)


@pytest.fixture(scope="session")
def daemon(tiny_model) -> Daemon:
    """One daemon for the tests that leave it running: --api-key API_KEY, --served-model-name SERVED_NAME,
    --max-model-len 256."""
    d = start_daemon(tiny_model, "--api-key", API_KEY, "--served-model-name", SERVED_NAME)
    yield d
    status = d.stop()
    assert status == 0, d.log()[-3000:]


@pytest.fixture(scope="session")
def small_daemon(tiny_model) -> Daemon:
    """A small daemon: two sequences at once, eight waiting (the rest get 429), a 64-token context;
    no API key."""
    d = start_daemon(tiny_model, "--max-queue", "8", "--max-num-seqs", "2", "--max-model-len", "64",
                     "--served-model-name", SMALL_NAME)
    yield d
    status = d.stop()
    assert status == 0, d.log()[-3000:]
