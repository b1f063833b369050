"""Does a cuBLAS GEMM pay extra the first time it meets a row count? (issue 18's first/twin TTFT gap)

    python tools/first_call_probe.py --out DIR [--rows 40] [--free-mib 4096]

Over HTTP the first prompt of a length took ~7 ms more than a second prompt of the same length
(session 10: first/twin p99 3.47), with no Triton build. Prefill GEMMs above 16 rows are torch's
F.linear (cuBLAS), whose kernel depends on the row count; under CUDA's lazy module loading (the
default since CUDA 12.2) a kernel's module loads at its first launch. This probe times, on a card
filled like the daemon's (all but --free-mib taken), F.linear at Qwen3-30B-A3B's prefill shapes
(q/k/v 2048 -> 5120, o_proj 4096 -> 2048, the router 2048 -> 128) for random row counts in
17..4,096: the first call of each count, then the same count again, each synchronized. It runs
itself twice in fresh processes, CUDA_MODULE_LOADING=LAZY and EAGER, and writes DIR/first_call.json
with both: if the first call's excess goes with EAGER, lazy loading is the cause. The allocator's
cudaMalloc count and retries during the first calls are recorded too (the other suspect).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {"qkv": (5120, 2048), "o_proj": (2048, 4096), "router": (128, 2048)}


def child(rows: int, free_mib: int) -> dict:
    import torch

    torch.cuda.init()
    free, _ = torch.cuda.mem_get_info()
    filler = torch.empty(max(0, free - free_mib * (1 << 20)), dtype=torch.uint8, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = {k: torch.randn(n, kk, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
               for k, (n, kk) in SHAPES.items()}
    counts = random.Random(3).sample(range(17, 4097), rows)

    def timed(m: int, w: torch.Tensor) -> float:
        x = torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16, generator=g)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for w in weights.values():  # cuBLAS's handle, workspace and the first module out of the way
        timed(64, w)
    rows_out = []
    for m in counts:
        stats0 = torch.cuda.memory_stats()
        first = {k: timed(m, w) for k, w in weights.items()}
        stats1 = torch.cuda.memory_stats()
        again = {k: timed(m, w) for k, w in weights.items()}
        rows_out.append({"m": m, "first": first, "again": again,
                         "mallocs": stats1.get("num_device_alloc", 0) - stats0.get("num_device_alloc", 0),
                         "retries": stats1["num_alloc_retries"] - stats0["num_alloc_retries"]})
    excess = [sum(r["first"].values()) - sum(r["again"].values()) for r in rows_out]
    del filler
    return {"loading": os.environ.get("CUDA_MODULE_LOADING", "(unset: LAZY)"), "free_mib": free_mib,
            "rows": rows_out, "excess_ms": {"p50": statistics.median(excess) * 1e3, "max": max(excess) * 1e3,
                                            "mean": statistics.mean(excess) * 1e3}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--free-mib", type=int, default=4096)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.rows, args.free_mib)))
        return 0
    result = {}
    for loading in ("LAZY", "EAGER"):
        env = {**os.environ, "CUDA_MODULE_LOADING": loading}
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, "--child", "--rows", str(args.rows), "--free-mib",
                            str(args.free_mib)], env=env, capture_output=True, text=True, timeout=240)
        if p.returncode:
            print(p.stderr[-2000:], file=sys.stderr)
            return p.returncode
        result[loading] = json.loads(p.stdout.strip().splitlines()[-1])
        result[loading]["process_s"] = time.perf_counter() - t0
        e = result[loading]["excess_ms"]
        firsts = sum(r["mallocs"] for r in result[loading]["rows"])
        print(f"{loading:5s}: a row count's first GEMMs (3 shapes) took {e['p50']:.2f} ms more than again "
              f"at p50, {e['max']:.2f} max; cudaMallocs during first calls {firsts}; process "
              f"{result[loading]['process_s']:.1f} s", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "first_call.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
