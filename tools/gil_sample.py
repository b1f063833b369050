"""Which thread of a running Python process holds the GIL, and in what code: py-spy sampled while something runs.

    with GilSample(pid) as gil:   # py-spy record --gil --threads --nonblocking, 1,000 samples a second
        ...                       # the work to watch
    gil.summary()                 # {"samples": N, "threads": [{"thread", "samples", "share", "top": [...]}]}

For issue 18's burst (tools/bench_served.py): the running streams' longest gaps coincide with step launches
that spent milliseconds off the CPU (radiance_step_launch_wait_seconds); if another thread holds the GIL then,
its samples say which and where. `--nonblocking` reads the process without pausing it, so sampling does not
add gaps of its own (py-spy's default stops the process at each sample). Without py-spy on PATH, or where it
may not attach (ptrace), `summary()` says why instead.
"""

from __future__ import annotations

import collections
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

RATE = 1000  # samples a second
TOP = 8  # frames listed per thread
OURS = ("radianced", "starlette", "uvicorn", "h11", "logging")  # frames of ours and the serving libraries


class GilSample:
    def __init__(self, pid: int, rate: int = RATE):
        self.pid, self.rate = pid, rate
        self._proc: subprocess.Popen | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="radiance-gil-"))
        self._why = ""

    def __enter__(self) -> GilSample:
        exe = shutil.which("py-spy")
        if exe is None:
            self._why = "py-spy not on PATH (tools/fetch_wheels.sh carries it to the device)"
            return self
        self._proc = subprocess.Popen(
            [exe, "record", "--gil", "--threads", "--nonblocking", "--rate", str(self.rate), "--format", "raw",
             "--output", str(self._dir / "raw.txt"), "--pid", str(self.pid)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
        try:
            said, _ = self._proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            said, _ = self._proc.communicate()
        if not (self._dir / "raw.txt").exists():
            self._why = f"py-spy wrote nothing (exit {self._proc.returncode}): {said.strip()[-400:]}"

    def summary(self) -> dict:
        raw = self._dir / "raw.txt"
        if self._why or not raw.exists():
            return {"samples": 0, "threads": [], "why": self._why or "not run"}
        return summarize(raw.read_text())


def summarize(raw: str) -> dict:
    """py-spy's raw (collapsed) stacks, `thread (tid): name;frame;frame... count` with --threads, as the samples
    each thread held the GIL in, and its most-sampled innermost frames of our code and the libraries it calls."""
    per_thread: collections.Counter[str] = collections.Counter()
    frames: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, *calls = stack.split(";")
        n = int(count)
        per_thread[thread] += n
        ours = [c for c in calls if any(o in c for o in OURS)]
        frames[thread][(ours or calls or ["(no Python frame)"])[-1]] += n
    total = sum(per_thread.values())
    return {"samples": total, "threads": [
        {"thread": t, "samples": n, "share": n / total,
         "top": [{"frame": f, "samples": k} for f, k in frames[t].most_common(TOP)]}
        for t, n in per_thread.most_common()]}


def lines(summary: dict) -> list[str]:
    """The summary as text: a line per thread, its top frames indented."""
    if not summary["samples"]:
        return [f"GIL holders: none sampled ({summary.get('why', 'no samples')})"]
    out = [f"GIL holders ({summary['samples']} samples at {RATE}/s):"]
    for t in summary["threads"]:
        out.append(f"  {t['thread']}: {t['samples']} ({t['share']:.0%})")
        out += [f"      {f['samples']:5d} {f['frame']}" for f in t["top"]]
    return out
