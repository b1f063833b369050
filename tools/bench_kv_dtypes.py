"""Issue 21's engine rows: each KV cache dtype's pool at one card budget, and its decode steps at 1K and 16K.

    python tools/bench_kv_dtypes.py --out DIR [--quick] [--layers 8] [--dir /var/tmp]
        # -> DIR/kv_dtypes.json, DIR/kv_dtypes.md

One synthetic Qwen3-30B-A3B-shaped model (tools/make_synthetic.py, every expert on the card), built as the
daemon builds it at the same `--gpu-memory-mib` with `--kv-cache-dtype` auto, fp8, fp8_v4 and k6_v4 in turn:

- the pool: the receipt's KV pool tokens against the blocks the allocator can hand out at start (x 16 tokens),
  which the issue asks to match for every dtype;
- decode: c sequences (8 and 32) of random prompts CONTEXT tokens long (1K and 16K), prefilled, then decode
  steps timed as tools/bench_tiers.py times them (the wall clock around `Engine.step`, graphs replayed), each
  dtype's step against auto's at the same (c, context). The issue's bar: at 1K no step slower than auto's by
  more than 5%. At 16K the step shows what the attention's time (tests/gpu/test_kv_quant_gpu.py's bar) is
  worth in a whole step.

Without CUDA (`--quick`): width / 8, 2 layers, contexts of 64 and 256 tokens, c = 2 and 4: it proves the code runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402

from radianced.config import KV_CACHE_DTYPES, Config  # noqa: E402
from radianced.engine.engine import Engine  # noqa: E402
from radianced.engine.request import Request  # noqa: E402
from radianced.engine.sampling_params import SamplingParams  # noqa: E402
from radianced.model.rad import RadFile  # noqa: E402
from tools import gpu_bench  # noqa: E402
from tools.make_synthetic import make_synthetic  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    layers: int
    narrow: int
    vocab: int | None
    dtype: str
    gpu_memory_mib: int
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    warm: int
    steps: int


FULL = Sizes(8, 1, None, "bf16", 65536, (1024, 16384), (8, 32), 8, 32)
QUICK = Sizes(2, 8, 2048, "f32", 1024, (64, 256), (2, 4), 2, 4)


def build(rad: RadFile, s: Sizes, device: str, kv_dtype: str) -> Engine:
    cfg = Config(max_model_len=max(s.contexts) + s.warm + s.steps + 8, max_num_seqs=max(s.batches),
                 max_num_batched_tokens=8192, gpu_memory_mib=s.gpu_memory_mib, placement="resident",
                 kv_cache_dtype=kv_dtype)
    return Engine.build(rad, cfg, device=device)


def pool(engine: Engine) -> dict:
    """The receipt's KV pool against what the allocator can hand out now (before any request)."""
    blocks = engine.scheduler.allocator.num_allocatable()
    tokens = blocks * engine.scheduler.block_size
    return {"receipt_tokens": engine.receipt.kv_pool_tokens, "allocatable_tokens": tokens,
            "lines": [line for line in engine.receipt.lines() if line.startswith(("kv", "kv_attn"))]}


def decode_steps(engine: Engine, device: str, c: int, context: int, s: Sizes, seed: int) -> list[float]:
    """Prefill c prompts of `context` tokens, then `warm` decode steps, then `steps` timed ones (seconds)."""
    vocab = engine.runner.vocab_size
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=s.warm + s.steps + 4, ignore_eos=True)
    for i in range(c):
        engine.add(Request(f"c{c}-{context}-{i}", tuple(torch.randint(0, vocab, (context,), generator=g).tolist()),
                           params))
    try:
        while any(seq.is_prefilling for seq in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        for _ in range(s.warm):
            engine.step()
        times = []
        for _ in range(s.steps):
            t0 = time.perf_counter()
            engine.step()
            gpu_bench._sync(device)
            times.append(time.perf_counter() - t0)
        return times
    finally:
        engine.scheduler.abort_all()


def run(out: Path, s: Sizes, device: str, folder: Path) -> dict:
    path = folder / f"radianced-kv-dtypes-{s.layers}l.rad"
    make_synthetic(path, layers=s.layers, zipf=1.0, dtype=s.dtype, vocab=s.vocab, narrow=s.narrow, device=device,
                   progress=False)
    res: dict = {"env": gpu_bench.section_env(out), "sizes": vars(s).copy(), "dtypes": {}}
    try:
        with RadFile.open(path) as rad:
            for kv_dtype in KV_CACHE_DTYPES:
                engine = build(rad, s, device, kv_dtype)
                row = {"pool": pool(engine), "steps": {}}
                for context in s.contexts:
                    for c in s.batches:
                        row["steps"][f"{c}x{context}"] = decode_steps(engine, device, c, context, s, seed=c + context)
                engine.close()
                del engine
                gpu_bench._free_cuda()
                res["dtypes"][kv_dtype] = row
                (out / "kv_dtypes.json").write_text(json.dumps(res, indent=1, default=str))
                print(f"{kv_dtype}: done", flush=True)
    finally:
        path.unlink(missing_ok=True)
    return res


def render(res: dict) -> str:
    env = res.get("env", {})
    lines = [f"## KV cache dtypes in the engine: {env.get('device')}, {env.get('date_utc')}, "
             f"commit {env.get('commit')}",
             "", "| dtype | pool tokens: receipt / allocatable | " + " | ".join(
                 f"step {k} ms (vs auto)" for k in res["dtypes"].get("auto", {}).get("steps", {})) + " |",
             "|---|---|" + "---|" * len(res["dtypes"].get("auto", {}).get("steps", {}))]
    auto = res["dtypes"].get("auto", {}).get("steps", {})
    for kv_dtype, row in res["dtypes"].items():
        p = row["pool"]
        cells = []
        for key, times in row["steps"].items():
            ms = 1e3 * statistics.median(times)
            ref = 1e3 * statistics.median(auto[key]) if key in auto else None
            cells.append(f"{ms:.3f}" + (f" ({ms / ref:.2f})" if ref else ""))
        same = "=" if p["receipt_tokens"] == p["allocatable_tokens"] else "!="
        lines.append(f"| {kv_dtype} | {p['receipt_tokens']:,} {same} {p['allocatable_tokens']:,} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="the CPU dry run's sizes (the default without CUDA)")
    ap.add_argument("--layers", type=int, help="decoder layers of the synthetic model (default 8; 2 --quick)")
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="folder for the model")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    s = QUICK if args.quick or device == "cpu" else FULL
    if args.layers:
        s = Sizes(**{**vars(s), "layers": args.layers})
    args.out.mkdir(parents=True, exist_ok=True)
    res = run(args.out, s, device, args.dir)
    (args.out / "kv_dtypes.md").write_text(render(res))
    print(render(res), flush=True)
    bad = [d for d, r in res["dtypes"].items() if r["pool"]["receipt_tokens"] != r["pool"]["allocatable_tokens"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
