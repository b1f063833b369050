"""Does a cuBLAS GEMM pay extra the first time it meets a row count? (issue 18's first/twin TTFT gap)

    python tools/first_call_probe.py --out DIR [--rows 40] [--free-mib 4096]

Over HTTP the first prompt of a length took ~7 ms more than a second prompt of the same length
(session 10: first/twin p99 3.47), with no Triton build. Prefill GEMMs above 16 rows are torch's
F.linear (cuBLAS), whose kernel depends on the row count; under CUDA's lazy module loading (the
default since CUDA 12.2) a kernel's module loads at its first launch. This probe times, on a card
filled like the daemon's (all but --free-mib taken), F.linear at Qwen3-30B-A3B's prefill shapes
(q/k/v 2048 -> 5120, o_proj 4096 -> 2048, the router 2048 -> 128) for random row counts in
17..4,096: the first call of each count, then the same count again, each synchronized. It runs
itself in fresh processes, CUDA_MODULE_LOADING=LAZY and EAGER, and writes DIR/first_call.json
with both: if the first call's excess goes with EAGER, lazy loading is the cause. The allocator's
cudaMalloc count and retries during the first calls are recorded too (the other suspect).
A third run, LAZY+buckets, goes through kernels/gemm.py (rows padded to a bucket) after its
`warm_up` (every bucket up to 4,096 rows): the fix, if the first call's excess is gone there.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"qkv": (5120, 2048), "o_proj": (2048, 4096), "router": (128, 2048)}


def child(rows: int, free_mib: int, bucketed: bool) -> dict:
    import torch

    from radianced.kernels import gemm

    torch.cuda.init()
    free, _ = torch.cuda.mem_get_info()
    filler = torch.empty(max(0, free - free_mib * (1 << 20)), dtype=torch.uint8, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = {k: torch.randn(n, kk, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
               for k, (n, kk) in SHAPES.items()}
    counts = random.Random(3).sample(range(17, 4097), rows)

    mm = gemm.linear if bucketed else torch.nn.functional.linear

    def timed(m: int, w: torch.Tensor) -> float:
        x = torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16, generator=g)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        mm(x, w)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for w in weights.values():  # cuBLAS's handle, workspace and the first module out of the way
        timed(64, w)
        if bucketed:
            timed(4096, w)  # the most rows, as the daemon's warm-up steps meet them
    warm_s = time.perf_counter()
    warmed = gemm.warm_up() if bucketed else 0
    warm_s = time.perf_counter() - warm_s
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
            "bucketed": bucketed, "warm_calls": warmed, "warm_s": warm_s,
            "rows": rows_out, "excess_ms": {"p50": statistics.median(excess) * 1e3, "max": max(excess) * 1e3,
                                            "mean": statistics.mean(excess) * 1e3}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--free-mib", type=int, default=4096)
    ap.add_argument("--child", choices=("plain", "bucketed"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.rows, args.free_mib, args.child == "bucketed")))
        return 0
    result = {}
    for run in ("LAZY", "EAGER", "LAZY+buckets"):
        loading, _, buckets = run.partition("+")
        env = {**os.environ, "CUDA_MODULE_LOADING": loading}
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, "--child", "bucketed" if buckets else "plain", "--rows",
                            str(args.rows), "--free-mib", str(args.free_mib)], env=env, capture_output=True,
                           text=True, timeout=240)
        if p.returncode:
            print(p.stderr[-2000:], file=sys.stderr)
            return p.returncode
        r = result[run] = json.loads(p.stdout.strip().splitlines()[-1])
        r["process_s"] = time.perf_counter() - t0
        e = r["excess_ms"]
        firsts = sum(row["mallocs"] for row in r["rows"])
        print(f"{run:12s}: a row count's first GEMMs (3 shapes) took {e['p50']:.2f} ms more than again "
              f"at p50, {e['max']:.2f} max; cudaMallocs during first calls {firsts}; warm-up {r['warm_calls']} "
              f"calls in {r['warm_s']:.2f} s; process {r['process_s']:.1f} s", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "first_call.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
