"""Decode-graph capture is immune to what the process did before it.

The bug (seen twice on the H200, issue 17): `test_pipelined_graph_steps_give_the_sequential_tokens
[qwen3_next-penalties]` failed with "operation failed due to a previous error during capture"
at the DeltaNet decode launch. Cause: Python's cyclic garbage collector ran inside the capture
and finalized a dead engine's pinned host memory (`cudaHostUnregister`), which invalidates a
global-mode capture. The first test pins that mechanism with torch alone (so the regression test
after it means something); the second forces a collection inside `StepGraphs`' capture; the
third captures in fresh processes for every sampling mode on every family (tools/gpu_check
repeats it 20 times).
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from radianced.card import Card
from radianced.config import Config
from radianced.engine import engine as engine_module
from radianced.engine.engine import Engine
from radianced.graph_shapes import decode_buckets
from tests.engine.conftest import tiny_rads  # noqa: F401 (fixture)
from tests.gpu.capture_modes import EXPERTS, MODES, pinned_cycle
from tests.gpu.conftest import HERE, gpu_device

ROOT = HERE.parents[1]


def _need_cuda():
    if gpu_device() != "cuda":
        pytest.skip("CUDA graphs need CUDA")


def test_a_collection_inside_a_capture_that_unpins_host_memory_invalidates_it():
    """The failure mode itself, in a process of its own: garbage whose finalizer unpins host
    memory, collected inside a plain torch capture, breaks that capture."""
    _need_cuda()
    script = textwrap.dedent("""
        import gc, torch
        from tests.gpu.capture_modes import pinned_cycle
        x = torch.zeros(16, device="cuda")
        owner = pinned_cycle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                del owner  # garbage now, inside the capture
                gc.set_threshold(1, 1, 1)  # the next allocation collects, as an unlucky count would
                for _ in range(10):
                    x.add_(1)
        except Exception as e:
            print("FAILED:", e)
        else:
            print("CAPTURED")
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "FAILED:" in run.stdout and "capture" in run.stdout, run.stdout + run.stderr


class _Leaky:
    """The model, but every forward drops the last reference to a pinned-memory cycle (pinned
    before any capture) and asks the collector to run at the next allocation: inside a capture,
    unless collection is off."""

    def __init__(self, model, forwards: int):
        self.model = model
        self.cfg = model.cfg
        self.mtp = model.mtp
        self.owners = [pinned_cycle() for _ in range(forwards)]

    def forward(self, batch, cache):
        if self.owners:
            self.owners.pop()  # garbage now
        saved = gc.get_threshold()
        gc.set_threshold(1, 1, 1)
        try:
            return self.model.forward(batch, cache)
        finally:
            gc.set_threshold(*saved)


def test_decode_graphs_capture_while_dead_pinned_memory_awaits_collection(tiny_rads):  # noqa: F811
    _need_cuda()
    rad = tiny_rads["qwen3_next"]
    cfg = Config(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, enforce_eager=True, **EXPERTS)
    engine = Engine.build(rad, cfg, Card.from_mib(1024), "cuda")
    engine.runner.model = _Leaky(engine.runner.model, forwards=2 * len(decode_buckets(cfg.max_num_seqs)))
    graphs = engine_module._step_graphs(engine, cfg, engine.receipt, True)  # every bucket captured
    assert sorted(graphs._graphs) == list(graphs.buckets)
    gc.collect()  # the cycles go now, outside any capture
    torch.cuda.synchronize()
    engine.close()


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "qwen3_next"])
def test_decode_graphs_captured_in_a_fresh_process_serve_every_sampling_mode(family):
    _need_cuda()
    run = subprocess.run([sys.executable, "-m", "tests.gpu.capture_modes", family], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    modes = json.loads(run.stdout.strip().splitlines()[-1])["modes"]
    assert sorted(modes) == sorted(MODES)
    for name, m in modes.items():
        assert m["equal"], (name, m["eager"], m["graphs"])
