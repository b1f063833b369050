"""radianced/cpu_threads.py: the daemon's CPU thread count, and OpenMP's binding variables dropped before torch
loads, so that no thread of the daemon or of its HTTP front is held to one CPU."""

from __future__ import annotations

import glob
import os

import psutil
import pytest

from radianced import cpu_threads
from tests.server.conftest import start_daemon, tiny_model  # noqa: F401 (fixture)


def test_count_is_the_given_threads_else_every_usable_core(monkeypatch):
    monkeypatch.setenv("RADIANCED_CPU_THREADS", "3")
    assert cpu_threads.count() == 3
    monkeypatch.setenv("RADIANCED_CPU_THREADS", "0")
    assert cpu_threads.count() == 1
    monkeypatch.delenv("RADIANCED_CPU_THREADS")
    assert cpu_threads.count() == len(os.sched_getaffinity(0))


def test_drop_binding_removes_what_binds_and_keeps_the_rest():
    env = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores", "GOMP_CPU_AFFINITY": "0-1", "OMP_NUM_THREADS": "2"}
    assert cpu_threads.drop_binding(env) == {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores",
                                             "GOMP_CPU_AFFINITY": "0-1"}
    assert env == {"OMP_NUM_THREADS": "2"}
    unbound = {"OMP_PROC_BIND": " FALSE "}  # binds nothing: left as it is
    assert cpu_threads.drop_binding(unbound) == {} and unbound == {"OMP_PROC_BIND": " FALSE "}


def test_prepare_openmp_spins_briefly_unless_told_and_drops_the_binding(monkeypatch):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", *cpu_threads.BINDING):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_PLACES", "cores")
    assert cpu_threads.prepare_openmp() == {"OMP_PLACES": "cores"} and "OMP_PLACES" not in os.environ
    assert os.environ["GOMP_SPINCOUNT"] == "20000"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the user's wait policy: no spin count of ours
    assert cpu_threads.prepare_openmp() == {} and "GOMP_SPINCOUNT" not in os.environ


def _allowed(pid: int) -> set[str]:
    """Each thread's Cpus_allowed_list of process `pid`."""
    return {next(line.split()[1] for line in open(f"{task}/status") if line.startswith("Cpus_allowed_list"))
            for task in glob.glob(f"/proc/{pid}/task/*")}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to tell one from all")
def test_a_daemon_started_with_omp_proc_bind_keeps_every_cpu_and_says_what_it_ignored(tiny_model):
    mine = _allowed(os.getpid())
    d = start_daemon(tiny_model, env={"OMP_PROC_BIND": "true", "RADIANCED_CPU_THREADS": "2"})
    try:
        procs = [d.pid] + [p.pid for p in psutil.Process(d.pid).children(recursive=True)]
        assert len(procs) >= 2  # the daemon and its HTTP front
        for pid in procs:
            assert _allowed(pid) == mine, pid
        assert "ignored OMP_PROC_BIND=true: OpenMP would hold every thread" in d.log_with("ignored OMP_PROC_BIND")
    finally:
        d.stop()
