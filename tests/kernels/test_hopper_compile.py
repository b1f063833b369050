"""The attention, MoE and Gated DeltaNet launches compile for Hopper (sm_90) here, with Triton's compiler and
ptxas: what the interpreter's tests cannot see (tests/kernels/hopper_compile.py says how and why)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


SHARDS = 2  # processes sharing the compiles (CI's machine has 2 cores)


def test_the_attention_and_moe_launches_compile_for_sm_90_and_no_bf16_key_loop_spills(tmp_path):
    procs = []
    for i in range(SHARDS):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = str(tmp_path / str(i))  # built here, not found in a cache
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.kernels.hopper_compile", "--shard",
                                       f"{i}/{SHARDS}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, out[-4000:] + err[-4000:]
        assert "0 cases did not compile, 0 spill" in out, out[-4000:]
