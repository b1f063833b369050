"""Which kernel variants a served request still builds after start-up (issue 18).

    python tools/compile_probe.py --out DIR [--layers 8] [--requests 40] [--bursts 6] [--families ...]

For each model (a synthetic Qwen3-30B-A3B of --layers layers, resident, and the
tiny families converted from transformers), builds the engine as the daemon does
(`Engine.build`, Triton's compile hook installed first: kernels/compiles.py) and
warms it up as the daemon does (engine/warmup.py), then switches the phase to "serving" and serves prompts of random lengths from 1
to 4,000 tokens (random ids), one at a time and in bursts of 8 mixed lengths, 4
greedy tokens each, recording every kernel variant built and each request's
seconds to its first token (the engine stepped directly). Writes
DIR/compile_probe.json and prints, per model, the builds by phase and the
kernels built while serving.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radianced.config import Config  # noqa: E402
from radianced.engine.engine import Engine  # noqa: E402
from radianced.engine.request import Request  # noqa: E402
from radianced.engine.sampling_params import SamplingParams  # noqa: E402
from radianced.engine.warmup import warm_up  # noqa: E402
from radianced.kernels.compiles import CompileLog  # noqa: E402
from radianced.model.rad import RadFile  # noqa: E402

MiB = 2**20


def serve(engine: Engine, prompts: list[list[int]], tag: str) -> list[float]:
    """Add the prompts together, step until all finish; seconds to each one's first token."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    start = time.perf_counter()
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add(Request(rid, tuple(p), params))
    first: dict[str, float] = {}
    while engine.scheduler.has_unfinished:
        for ev in engine.step():
            if ev.token_ids and ev.request_id not in first:
                first[ev.request_id] = time.perf_counter() - start
    return [first[r] for r in ids]


def probe(name: str, rad: RadFile, cfg: Config, args, log: CompileLog) -> dict:
    from radianced.card import detect_card

    log.phase = "start-up"
    before = log.count()
    t0 = time.perf_counter()
    engine = Engine.build(rad, cfg, detect_card("cuda"), device="cuda", sampler_seed=0)
    built = log.count()
    report = warm_up(engine, cfg.max_num_batched_tokens, cfg.max_num_seqs, engine.receipt.max_model_len,
                     cfg.speculative, rad.model.vocab_size)
    startup = {"seconds": time.perf_counter() - t0, "builds": log.count() - before,
               "warmup_builds": log.count() - built, "warmup_seconds": report.seconds, "warmup_steps": report.steps}
    log.phase = f"serving {name}"
    rng = random.Random(0)
    vocab = rad.model.vocab_size
    top = min(4000, engine.receipt.max_model_len - 8)
    rows = []
    for i in range(args.requests):
        n = rng.randint(1, top)
        k = log.count()
        (ttft,) = serve(engine, [[rng.randrange(vocab) for _ in range(n)]], f"one{i}")
        rows.append({"kind": "one", "lengths": [n], "ttft": [ttft], "builds": log.count() - k})
    for i in range(args.bursts):
        lengths = [rng.randint(1, top // 8) for _ in range(8)]
        k = log.count()
        ttfts = serve(engine, [[rng.randrange(vocab) for _ in range(n)] for n in lengths], f"burst{i}")
        rows.append({"kind": "burst", "lengths": lengths, "ttft": ttfts, "builds": log.count() - k})
    serving = [b for b in log.builds if b.phase == log.phase]
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return {"startup": startup, "requests": rows, "serving_builds": len(serving),
            "serving_by_kernel": dict(log.by_kernel(log.phase)),
            "serving_details": [{"kernel": b.kernel, "kind": b.kind, "detail": b.detail[:600]} for b in serving]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--bursts", type=int, default=6)
    ap.add_argument("--families", nargs="*", default=["synthetic", "qwen3_next", "llama"])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = CompileLog.install()
    result = {}
    with tempfile.TemporaryDirectory(dir="/var/tmp" if Path("/var/tmp").is_dir() else None) as d:
        for fam in args.families:
            if fam == "synthetic":
                from tools.make_synthetic import make_synthetic
                path = make_synthetic(Path(d) / "m.rad", layers=args.layers, zipf=1.0, device="cuda", progress=False)
                cfg = Config(placement="resident", embedding_placement="vram", max_model_len=8192, max_num_seqs=8,
                             max_num_batched_tokens=4096)
            else:
                from radianced.model.convert import convert
                from radianced.model.tiny import make_tiny
                src = make_tiny(fam, Path(d) / fam)
                path = src / "model.rad"
                convert(src, path, dtype="bf16")  # bf16: fla's prefill kernels (fp32 takes the reference's)
                cfg = Config(max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=4096)
            torch.zeros(1, device="cuda")
            free, total = torch.cuda.mem_get_info()
            cfg = msgspec.structs.replace(cfg, gpu_memory_mib=(total - free + path.stat().st_size) // MiB + 8192)
            result[fam] = probe(fam, RadFile.open(path), cfg, args, log)
            r = result[fam]
            one = sorted(t for row in r["requests"] if row["kind"] == "one" for t in row["ttft"])
            print(f"{fam}: start-up {r['startup']['seconds']:.1f} s, {r['startup']['builds']} builds (warm-up "
                  f"{r['startup']['warmup_seconds']:.1f} s, {r['startup']['warmup_builds']} builds); serving "
                  f"{r['serving_builds']} builds {r['serving_by_kernel']}; one-at-a-time TTFT p50 "
                  f"{one[len(one) // 2] * 1e3:.0f} ms max {one[-1] * 1e3:.0f} ms", flush=True)
            (args.out / "compile_probe.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
