"""The --full stability pass, shortened to a few seconds, against a daemon the bench starts itself.

No time is asserted: only that the pass ran without error, sampled the daemon's
RSS, said "not measured" for GPU memory without NVML, and saw the KV back to
idle afterwards. About 15 s (the daemon's start-up most of it).
"""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest

from radianced.bench.daemon_process import ChildDaemon
from radianced.bench.sizes import DaemonLimits, Sizes
from radianced.bench.workloads import MEMORY_SAMPLE_S, BenchContext, stability
from radianced.model.default import ensure_default_model

SECONDS = 2 * MEMORY_SAMPLE_S + 1  # three RSS samples


@pytest.fixture(scope="module")
def daemon():
    try:
        ensure_default_model()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    mp = pytest.MonkeyPatch()
    mp.setenv("RADIANCED_CPU_THREADS", "1")
    mp.setenv("OMP_NUM_THREADS", "1")
    try:
        child = ChildDaemon.start(["--card-mib", "2048", "--max-model-len", "256", "--max-num-seqs", "2"])
    finally:
        mp.undo()
    yield child
    assert child.stop() == 0, child.log()[-3000:]


async def _stability(url: str, pid: int):
    limits = DaemonLimits(2, 0, 256)
    sizes = dataclasses.replace(Sizes.choose(limits, quick=True, full=False), stability_s=SECONDS,
                                stability_concurrency=2, sweep_tokens=8)
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        ctx = BenchContext(http, sizes, limits, "smollm2-135m-instruct", None, pid, lambda *a: None)
        return await stability(ctx)


def test_a_short_stability_pass_has_no_error_a_rss_slope_and_idle_kv_after(daemon):
    [row] = asyncio.run(_stability(daemon.url, daemon.proc.pid))
    assert (row.name, row.concurrency) == ("stability", 2)
    assert row.samples and all(s.ok and s.tokens_received == 8 for s in row.samples)
    assert row.notes["errors"] == 0 and row.notes["seconds"] == SECONDS
    assert isinstance(row.notes["rss_mib_per_min"], float)
    assert row.notes["gpu_mib_per_min"] == "not measured" and row.energy is None
    assert row.notes["kv_util_after_idle"] == 0.0
    assert row.server.generated_tokens == 8 * len(row.samples)
