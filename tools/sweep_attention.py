"""Issue 21's diagnosis: paged attention's time over an auto (bf16) and an fp8 cache as the tile
configuration varies, against the HBM floor of the bytes each reads.

    python tools/sweep_attention.py --out DIR

Decode at context 16K (b8, b32; Qwen3-30B-A3B's 32 / 4 heads x 128) over split counts, and a 4K
prefill (Qwen3-30B-A3B and Qwen3-Next's 16 / 2 x 256) over query-tile rows, warps and stages:
whether the kernels are bound by the bytes they read (then fp8 is faster by its bytes) or by
their own latency and arithmetic (then a configuration, not the format, sets the time). The
caches are tests/gpu/test_kv_quant_gpu.py's; `attention_config` is wrapped to take each
configuration. Writes DIR/sweep_attention.json and prints a table. CUDA only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radianced.kernels import attention, kv_fp8  # noqa: E402
from tests.gpu.test_kv_quant_gpu import SHAPES, _bench_caches  # noqa: E402

HBM_BYTES_S = 4.8e12  # the H200's HBM3e, as H200.md states it


@triton.jit
def own_only(own, offsets, BLOCK_SIZE: tl.constexpr):
    """`kv_fp8.add_block_first` left out (`--first-term none`)."""
    return own


@triton.jit
def first_by_gather(own, offsets, BLOCK_SIZE: tl.constexpr):
    """`kv_fp8.add_block_first` with each key's block-first logit taken by tl.gather (`--first-term gather`)."""
    M: tl.constexpr = own.shape[0]
    N: tl.constexpr = own.shape[1]
    first = tl.gather(own, tl.broadcast_to((tl.arange(0, N) - offsets)[None, :], [M, N]), 1)
    return own + tl.where((offsets > 0)[None, :], first, 0.0)


FIRST_TERMS = {"none": own_only, "gather": first_by_gather, "reshape": kv_fp8.add_block_first}


def timed(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def run_case(batch: int, ctx: int, rows: int, shape: str, overrides: list[dict]) -> list[dict]:
    hq, hkv, d = SHAPES[shape]
    out = []
    auto, quant, tables = _bench_caches(batch, ctx, hkv, d, "fp8")
    caches = {"auto": (auto, tables), "fp8": (quant, tables)}
    q = torch.randn((batch * rows, hq, d), device="cuda").bfloat16()
    qs = torch.arange(0, batch * rows + 1, rows, dtype=torch.int32, device="cuda")
    sl = torch.full((batch,), ctx, dtype=torch.int64, device="cuda")
    original = attention.attention_config
    for o in overrides:
        def config(*a, o=o, **kw):
            return dataclasses.replace(original(*a, **kw), **o)
        attention.attention_config = config
        try:
            for dtype, (cache, tables) in caches.items():
                k, v = cache.layer(1)
                try:
                    ms = timed(lambda: attention.paged_attention(q, k, v, tables, qs, sl, d ** -0.5))
                except Exception as e:  # a configuration the kernel cannot take (shared memory, registers)
                    out.append({"batch": batch, "ctx": ctx, "rows": rows, "shape": shape, "dtype": dtype, **o,
                                "error": str(e).splitlines()[0][:200]})
                    continue
                kv_bytes = batch * ctx * hkv * d * 2 * (2 if dtype == "auto" else 1) \
                    + (batch * ctx * hkv * 2 * 2 if dtype == "fp8" else 0)  # codes + fp16 scales a token
                row = {"batch": batch, "ctx": ctx, "rows": rows, "shape": shape, "dtype": dtype, **o,
                       "ms": ms, "kv_gb_s": kv_bytes / ms / 1e6, "hbm_share": kv_bytes / ms / 1e-3 / HBM_BYTES_S}
                out.append(row)
                print(json.dumps(row), flush=True)
        finally:
            attention.attention_config = original
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--first-term", choices=sorted(FIRST_TERMS),
                    help="fp8's block-first term in the K logits replaced (`none`: left out, wrong values, what "
                         "the term costs; `gather`: taken by tl.gather, not a reshape; `reshape`: the kernel's "
                         "own), default configurations and 128-key prefill tiles only; run in a process of its "
                         "own (a kernel compiled before the patch keeps its cache key)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.first_term:
        kv_fp8.add_block_first = FIRST_TERMS[args.first_term]
        rows = []
        for batch in (8, 32):
            rows += run_case(batch, 16384, 1, "qwen3", [{}])
        rows += run_case(1, 4096, 4096, "qwen3", [{}, {"block_n": 128}])
        (args.out / f"sweep_attention_first_term_{args.first_term}.json").write_text(json.dumps(rows, indent=1))
        return 0
    rows = []
    splits = [{}] + [{"num_splits": s} for s in (4, 8, 16, 32, 64)]
    stages = [{"num_stages": s} for s in (3, 4)]
    for batch in (8, 32):
        rows += run_case(batch, 16384, 1, "qwen3", splits + stages)
    prefill = [{}, {"num_stages": 3}, {"num_warps": 8}, {"block_m": 128, "block_q": 128 // 8, "num_warps": 8},
               {"block_n": 128}, {"block_n": 32}]
    rows += run_case(1, 4096, 4096, "qwen3", prefill)
    rows += run_case(1, 4096, 4096, "next", [{}, {"num_stages": 3}, {"num_warps": 4}, {"block_n": 64}])
    (args.out / "sweep_attention.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
