"""The attention and MoE launches compile for Hopper (sm_90) here, with Triton's compiler and ptxas: what the
interpreter's tests cannot see (tests/kernels/hopper_compile.py says how and why)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_attention_and_moe_launches_compile_for_sm_90_and_no_bf16_key_loop_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # built here, not found in a cache
    r = subprocess.run([sys.executable, "-m", "tests.kernels.hopper_compile"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "0 cases did not compile, 0 spill" in r.stdout, r.stdout[-4000:]
