"""Which thread of a running Python process holds the GIL, and in what code: py-spy sampled while something runs.

    with GilSample(pid) as gil:   # py-spy record --gil --threads --nonblocking, 1,000 samples a second
        ...                       # the work to watch
    gil.summary()                 # {"samples", "seconds", "rate", "threads": [{"thread", "samples", "of_wall", "top"}]}

For issue 18's burst (tools/bench_served.py): the running streams' longest gaps coincide with step launches
that spent milliseconds off the CPU (radiance_step_launch_wait_seconds); if another thread holds the GIL then,
its samples say which and where. `--nonblocking` reads the process without pausing it, so sampling does not
add gaps of its own (py-spy's default stops the process at each sample). With `--gil` py-spy keeps only the
samples in which some thread holds the GIL, so a thread's share of the wall time is about its samples over
rate x the seconds watched (`of_wall`; py-spy's sampling starts once it has attached and ends when it handles
the SIGINT, so a thread that held it throughout reads near 1, not exactly 1); what is left of 1 is the time no
thread held it. Without py-spy (on PATH or
beside this Python), or where it may not attach (ptrace), `summary()` says why instead.
"""

from __future__ import annotations

import collections
import shutil
import signal
import subprocess
import sys
import tempfile
import time
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
        self._t0 = self.seconds = 0.0

    def __enter__(self) -> GilSample:
        exe = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
        if exe is None:
            self._why = "py-spy not on PATH nor beside this Python (tools/fetch_wheels.sh carries it to the device)"
            return self
        with open(self._dir / "said.txt", "w") as said:  # a file, not a pipe: its warnings never fill a buffer
            self._proc = subprocess.Popen(
                [exe, "record", "--gil", "--threads", "--nonblocking", "--rate", str(self.rate), "--format", "raw",
                 "--output", str(self._dir / "raw.txt"), "--pid", str(self.pid)], stdout=said, stderr=said)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self.seconds = time.perf_counter() - self._t0
        self._proc.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if not (self._dir / "raw.txt").exists():
            said = (self._dir / "said.txt").read_text(errors="replace").strip()[-400:]
            self._why = f"py-spy wrote nothing (exit {self._proc.returncode}): {said}"

    def summary(self) -> dict:
        """The samples by thread (`summarize`), with the window's seconds; the files are removed."""
        raw = self._dir / "raw.txt"
        out = {"samples": 0, "threads": [], "why": self._why or "not run"}
        if not self._why and raw.exists():
            out = summarize(raw.read_text(), self.rate, self.seconds)
        shutil.rmtree(self._dir, ignore_errors=True)
        return out


def summarize(raw: str, rate: int = RATE, seconds: float = 0.0) -> dict:
    """py-spy's raw (collapsed) stacks, `thread (tid): name;frame;frame... count` with --threads, as the samples
    each thread held the GIL in (and, given the window's `seconds`, that as a share of the wall time), and its
    most-sampled innermost frames of our code and the libraries it calls."""
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
    wall = rate * seconds
    return {"samples": sum(per_thread.values()), "seconds": seconds, "rate": rate, "threads": [
        {"thread": t, "samples": n, "of_wall": n / wall if wall else None,
         "top": [{"frame": f, "samples": k} for f, k in frames[t].most_common(TOP)]}
        for t, n in per_thread.most_common()]}


def lines(summary: dict) -> list[str]:
    """The summary as text: a line per thread, its top frames indented."""
    if not summary["samples"]:
        return [f"GIL holders: none sampled ({summary.get('why', 'no samples')})"]
    out = [f"GIL holders ({summary['samples']} samples at {summary['rate']}/s over {summary['seconds']:.2f} s):"]
    for t in summary["threads"]:
        share = "" if t["of_wall"] is None else f", {t['of_wall']:.0%} of the wall time"
        out.append(f"  {t['thread']}: {t['samples']} samples{share}")
        out += [f"      {f['samples']:5d} {f['frame']}" for f in t["top"]]
    return out
