"""tools/gil_sample.py: py-spy's collapsed stacks as GIL holders by thread, and a live sample of a busy thread."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.gil_sample import GilSample, lines, summarize

RAW = """\
thread (11): radianced-step_0;Thread.run (threading.py:982);AsyncEngine._rounds (radianced/engine/driver.py:156);\
Engine.apply (radianced/engine/engine.py:156);PrefixCache.insert (radianced/kv/prefix.py:152) 3
thread (11): radianced-step_0;Thread.run (threading.py:982);AsyncEngine._rounds (radianced/engine/driver.py:156) 1
thread (7): MainThread;main (uvloop/__init__.py:61);Server.on_tick (uvicorn/server.py:240) 2
thread (7): MainThread;<module> (x.py:1);spin (x.py:3) 2
not a stack line
"""


def test_collapsed_stacks_become_each_threads_share_and_innermost_frames():
    s = summarize(RAW, rate=100, seconds=0.1)  # a window of 10 samples' time: 8 with a GIL holder
    assert (s["samples"], s["rate"], s["seconds"]) == (8, 100, 0.1)
    step, main = s["threads"]
    assert (step["thread"], step["samples"], step["of_wall"]) == ("thread (11): radianced-step_0", 4, 0.4)
    assert step["top"] == [{"frame": "PrefixCache.insert (radianced/kv/prefix.py:152)", "samples": 3},
                           {"frame": "AsyncEngine._rounds (radianced/engine/driver.py:156)", "samples": 1}]
    # no frame of ours or the serving libraries: the innermost frame stands for the stack
    assert [f["frame"] for f in main["top"]] == ["Server.on_tick (uvicorn/server.py:240)", "spin (x.py:3)"]
    assert lines(s)[0] == "GIL holders (8 samples at 100/s over 0.10 s):"
    assert lines(s)[1] == "  thread (11): radianced-step_0: 4 samples, 40% of the wall time"


def test_without_py_spy_the_summary_says_why(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name, path=None: None)
    with GilSample(1) as gil:
        pass
    s = gil.summary()
    assert s["samples"] == 0 and "py-spy not on PATH" in s["why"] and "none sampled" in lines(s)[0]


SPIN = """\
import threading, time
def busy_loop():
    t = time.time()
    while time.time() - t < 30:
        sum(range(1000))
threading.Thread(target=busy_loop, name="spinner").start()
print("go", flush=True)
"""


PY_SPY = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(PY_SPY is None, reason="py-spy not installed (the test extra has it)")
def test_a_live_process_busy_thread_holds_the_gil():
    proc = subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "go\n"
        with GilSample(proc.pid, rate=200) as gil:
            time.sleep(1.5)
        s = gil.summary()
    finally:
        proc.kill()
        proc.wait()
    if s["samples"] == 0 and any(w in s.get("why", "").lower() for w in ("ptrace", "permission")):
        pytest.skip(f"py-spy may not attach here: {s['why']}")
    spinner = s["threads"][0]
    assert spinner["thread"].endswith("spinner") and spinner["samples"] > 0.9 * s["samples"], s
    # it held the GIL all along: about 1 of the wall time (py-spy's samples start after it attaches and run until it
    # handles the SIGINT, while `seconds` is the window around them: a ratio near 1, not exactly 1)
    assert 0.2 < spinner["of_wall"] < 2 and s["seconds"] >= 1.5  # (loose: a loaded machine delays py-spy)
    assert "busy_loop" in spinner["top"][0]["frame"]
