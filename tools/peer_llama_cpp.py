"""Issue 24's llama.cpp peer: llama-bench on the same weights and card budget as radianced.

The `.rad` is written as llama.cpp's qwen3moe GGUF (tools/rad_to_gguf.py: F16 matrices, the `.rad`'s values)
and run by llama-bench (tools/build_llama_cpp.sh) the way llama.cpp users fit a MoE model bigger than the
card: every layer on the GPU (`-ngl 99`) except the routed experts of the first N layers, which stay in
host RAM and are computed there (`--n-cpu-moe N`). N is the fewest whose layers' experts leave the rest of
the model, the KV cache and llama.cpp's compute buffers (LLAMA_MARGIN_BYTES) inside the card budget
(`n_cpu_moe`). llama-bench reports the prompt's tokens a second (`-p`, one sequence) and the decode's
(`-n`, one sequence, after an empty context), `-r` repetitions each; b1 only (radianced's b1 row is the
one to compare).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
import time
from pathlib import Path

from radianced.model.rad import RadFile
from tools.rad_to_gguf import gguf_dtype, plan, write

LLAMA_MARGIN_BYTES = 2 << 30  # the KV cache at a short context and the CUDA compute buffers (measured: < 1.5 GiB)


def gguf_bytes(rad: RadFile) -> tuple[int, int]:
    """(bytes of everything but the routed experts, bytes of one layer's routed experts) in the GGUF
    rad_to_gguf writes: its own tensors, shapes and types (nothing is read)."""
    rest = experts = 0
    for name, shape, _ in plan(rad):
        n = math.prod(shape) * gguf_dtype(shape).itemsize
        if name.endswith("_exps.weight"):
            experts += n
        else:
            rest += n
    return rest, experts // rad.model.num_hidden_layers


def n_cpu_moe(rest: int, layer: int, layers: int, card_bytes: int, margin: int = LLAMA_MARGIN_BYTES) -> int:
    """The fewest layers whose routed experts stay in host RAM for the rest to fit `card_bytes`; ValueError
    when even all of them do not make it fit."""
    room = card_bytes - margin - rest
    if room < 0:
        raise ValueError(f"the model without its routed experts ({rest / 2**30:.1f} GiB) and llama.cpp's margin "
                         f"({margin / 2**30:.1f} GiB) do not fit the card budget ({card_bytes / 2**30:.1f} GiB)")
    on_card = min(layers, room // layer)
    return layers - on_card


def run_llama_bench(binary: Path, gguf: Path, n_cpu: int, prompt: int, tokens: int, repetitions: int,
                    timeout_s: float, gpu: bool, threads: int | None = None) -> dict:
    """llama-bench's JSON rows for the prompt and the decode (on `threads` CPU threads where given); the command and
    its wall time."""
    cmd = [str(binary), "-m", str(gguf), "-p", str(prompt), "-n", str(tokens), "-r", str(repetitions), "-o", "json"]
    if threads is not None:
        cmd += ["-t", str(threads)]
    cmd += ["-ngl", "99", "-ncmoe", str(n_cpu)] if gpu else ["-ngl", "0"]  # a CUDA build offloads by default
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench exited {done.returncode}: {done.stderr[-2000:]}")
    rows = json.loads(done.stdout)
    out = {"command": " ".join(cmd), "wall_s": time.perf_counter() - t0, "rows": rows}
    for r in rows:
        key = "prompt" if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0 else "decode"
        out[f"{key}_tok_s"] = r["avg_ts"]
        out[f"{key}_tok_s_stdev"] = r["stddev_ts"]
    return out


def section_llama_cpp(run, binary: Path, pick_dir) -> dict:
    """The peer's section of tools/bench_peer_offload.py (`run`: its Run; `pick_dir(need, candidates)`: a
    folder with room): the run's `.rad` as a GGUF, removed with the run's files, then llama-bench at the card
    budget (on the CPU in a quick run, every layer there: it proves the path, nothing about speed)."""
    run.check_time()
    if not binary.is_file():
        raise FileNotFoundError(f"{binary}: no llama-bench there (tools/build_llama_cpp.sh builds it)")
    s = run.sizes
    rad = RadFile.open(run.rad_path)
    try:
        rest, layer = gguf_bytes(rad)
        layers = rad.model.num_hidden_layers
        n_cpu = layers if s.quick else n_cpu_moe(rest, layer, layers, s.card_mib << 20)
        folder = tempfile.TemporaryDirectory(prefix="radianced-peer-gguf-", dir=pick_dir(
            rest + layers * layer, (os.environ.get("RADIANCED_DISK_DIR"), "/dev/shm", "/var/tmp", "/tmp")))
        run.tmp.append(folder)
        gguf = Path(folder.name) / "model.gguf"
        t0 = time.perf_counter()
        write(rad, gguf)
        written = time.perf_counter() - t0
    finally:
        rad.close()
    out = run_llama_bench(binary, gguf, n_cpu, s.prompt, s.tokens, 3, max(30.0, run.deadline - time.monotonic()),
                          gpu=not s.quick)
    return {**out, "n_cpu_moe": n_cpu, "layers": layers, "gguf_bytes": gguf.stat().st_size,
            "expert_bytes_per_layer": layer, "other_bytes": rest, "margin_bytes": LLAMA_MARGIN_BYTES,
            "written_s": written, "on_card_bytes": rest + (layers - n_cpu) * layer}
