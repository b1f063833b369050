"""tools/peer_llama_cpp.py: the layers whose experts llama.cpp keeps in host RAM are the fewest that fit the
card budget; the byte counts behind that are the GGUF's own; llama-bench's JSON becomes the peer's row; a
missing llama-bench is named with the way to build it."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from radianced.model.rad import RadFile
from tools.make_synthetic import make_synthetic
from tools.peer_llama_cpp import gguf_bytes, n_cpu_moe, run_llama_bench, section_llama_cpp
from tools.rad_to_gguf import write

GiB = 1 << 30


def test_the_fewest_layers_that_fit_the_budget_keep_their_experts_in_host_ram():
    # 24 layers of 1 GiB of experts, 3 GiB of the rest, 2 GiB of margin
    assert n_cpu_moe(3 * GiB, GiB, 24, 48 * GiB, 2 * GiB) == 0  # 29 GiB fit 48
    assert n_cpu_moe(3 * GiB, GiB, 24, 24 * GiB, 2 * GiB) == 5  # 19 layers' experts on the card
    assert n_cpu_moe(3 * GiB, GiB, 24, 5 * GiB, 2 * GiB) == 24
    with pytest.raises(ValueError, match="do not fit the card budget"):
        n_cpu_moe(3 * GiB, GiB, 24, 4 * GiB, 2 * GiB)


def test_the_byte_counts_are_the_gguf_files(tmp_path):
    rad = RadFile.open(make_synthetic(tmp_path / "m.rad", layers=2, vocab=2048, narrow=16, progress=False))
    try:
        rest, layer = gguf_bytes(rad)
        write(rad, tmp_path / "m.gguf")
    finally:
        rad.close()
    size = (tmp_path / "m.gguf").stat().st_size
    assert 0 <= size - (rest + 2 * layer) < 1 << 20  # the header and alignment: under a MiB


def _fake_llama_bench(tmp_path: Path, rows: list[dict]) -> Path:
    """A stand-in that prints llama-bench's JSON for the arguments it was given."""
    path = tmp_path / "llama-bench"
    path.write_text(f"#!/bin/sh\necho '{json.dumps(rows)}'\necho \"$@\" > {tmp_path}/args\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_llama_benchs_json_becomes_the_peers_row(tmp_path):
    rows = [{"n_prompt": 64, "n_gen": 0, "avg_ts": 900.0, "stddev_ts": 9.0},
            {"n_prompt": 0, "n_gen": 24, "avg_ts": 40.0, "stddev_ts": 0.5}]
    out = run_llama_bench(_fake_llama_bench(tmp_path, rows), tmp_path / "m.gguf", 5, 64, 24, 3, 10, gpu=True)
    assert (out["prompt_tok_s"], out["decode_tok_s"], out["decode_tok_s_stdev"]) == (900.0, 40.0, 0.5)
    assert (tmp_path / "args").read_text().split() == ["-m", str(tmp_path / "m.gguf"), "-p", "64", "-n", "24", "-r",
                                                       "3", "-o", "json", "-ngl", "99", "-ncmoe", "5"]


def test_a_missing_llama_bench_is_named_with_how_to_build_it(tmp_path):
    run = SimpleNamespace(check_time=lambda: None)
    with pytest.raises(FileNotFoundError, match="tools/build_llama_cpp.sh builds it"):
        section_llama_cpp(run, tmp_path / "llama-bench", None)
