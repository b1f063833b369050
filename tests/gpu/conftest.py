"""GPU tests: marked `gpu`, run by `tools/gpu_check` on an NVIDIA machine.

Every test in this folder gets the `gpu` marker and is skipped at collection
when CUDA is not available, so `make test` on a CPU machine reports them as
skipped and never builds their fixtures.

`RADIANCED_GPU_TEST_DEVICE=cpu` runs the same tests with the CPU standing in
for the device (CPU against CPU): a dry run of the test code itself, useful
before spending device time; it proves nothing about CUDA.
`RADIANCED_GPU_RESULTS=<file>` makes the tests append their measurements (one
JSON object a line) to that file; `tools/gpu_check` sets it and puts the
numbers into its report.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def gpu_device() -> str:
    return os.environ.get("RADIANCED_GPU_TEST_DEVICE", "cuda")


def record(entry: dict) -> None:
    """Append one measurement to $RADIANCED_GPU_RESULTS (JSON lines), if set."""
    path = os.environ.get("RADIANCED_GPU_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")


def ms_per_call(fn, iters: int = 50) -> float:
    """Milliseconds per call of `fn` on the current CUDA stream (one call first, then `iters` between events)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def pytest_collection_modifyitems(config, items):
    device = gpu_device()
    usable = device != "cuda" or torch.cuda.is_available()
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False); run by tools/gpu_check")
    for item in items:
        if HERE not in Path(str(item.fspath)).resolve().parents:
            continue  # this hook sees every collected test; only this folder's are ours
        item.add_marker(pytest.mark.gpu)
        if not usable:
            item.add_marker(skip)
