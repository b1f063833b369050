"""Issue 21's diagnosis: paged attention's time over an auto (bf16) and quantized caches as the tile
configuration varies, against the HBM floor of the bytes each reads.

    python tools/sweep_attention.py --out DIR [--dtypes auto,fp8,fp8_v4,k6_v4] [--dry-run]

Decode at context 16K (b8, b32; Qwen3-30B-A3B's 32 / 4 heads x 128) over split counts, and a 4K
prefill (Qwen3-30B-A3B and Qwen3-Next's 16 / 2 x 256) over query-tile rows, warps and stages:
whether the kernels are bound by the bytes they read (then fp8 is faster by its bytes) or by
their own latency and arithmetic (then a configuration, not the format, sets the time). The
caches are tests/gpu/test_kv_quant_gpu.py's; `attention_config` is wrapped to take each
configuration. Writes DIR/sweep_attention.json and prints a table. CUDA only.

`--dtypes` (default auto,fp8: 52 rows, about 70-120 s on the H200) adds fp8_v4 and k6_v4: the same
cases, and k6_v4's decode at 4 warps against its default 8 (tools/sass_loop.py: 4 spills in its key
loop). A row's override is what it changed and `config` what ran: attention_config's defaults move (fp8's
own since the 9ec6e66 sweep: 128-key prefill tiles at head dim <= 128, 3 stages at decode, so its `{}` rows
are no longer 9ec6e66's). `--dry-run` lists the rows a run would time, and needs no GPU.
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
from radianced.kernels.kv_formats import KV_FORMATS  # noqa: E402
from tests.gpu.test_kv_quant_gpu import BLOCK, SHAPES, _bench_caches  # noqa: E402

HBM_BYTES_S = 4.8e12  # the H200's HBM3e, as H200.md states it
DTYPES = ("auto", *KV_FORMATS)


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


def kv_bytes(dtype: str, batch: int, ctx: int, hkv: int, d: int) -> int:
    """The bytes of one layer's K and V (codes and scales) over batch x ctx tokens."""
    per_token = hkv * d * 2 * 2 if dtype == "auto" else KV_FORMATS[dtype].block_bytes(1, BLOCK, hkv, d) // BLOCK
    return batch * ctx * per_token


def caches_for(batch: int, ctx: int, hkv: int, d: int, dtypes: list[str]) -> dict:
    """dtype -> (a cache of `batch` sequences of `ctx` tokens, its block tables)."""
    out = {}
    for dtype in [dt for dt in dtypes if dt != "auto"] or ["fp8"]:
        auto, quant, tables = _bench_caches(batch, ctx, hkv, d, dtype)
        out.setdefault("auto", (auto, tables))  # one auto cache: the first call's
        out[dtype] = (quant, tables)
    return {dt: out[dt] for dt in dtypes}


def selected(overrides: list[dict], dtypes: list[str]) -> list[tuple[dict, list[str]]]:
    """Each override's fields (its `dtypes` key aside: the only dtypes it runs for, default all) and dtypes."""
    out = []
    for o in overrides:
        only = o.get("dtypes", DTYPES)
        out.append(({k: v for k, v in o.items() if k != "dtypes"}, [dt for dt in dtypes if dt in only]))
    return [(o, dts) for o, dts in out if dts]


def run_case(batch: int, ctx: int, rows: int, shape: str, overrides: list[dict], dtypes: list[str]) -> list[dict]:
    hq, hkv, d = SHAPES[shape]
    out = []
    caches = caches_for(batch, ctx, hkv, d, dtypes)
    q = torch.randn((batch * rows, hq, d), device="cuda").bfloat16()
    qs = torch.arange(0, batch * rows + 1, rows, dtype=torch.int32, device="cuda")
    sl = torch.full((batch,), ctx, dtype=torch.int64, device="cuda")
    original = attention.attention_config
    for o, dts in selected(overrides, dtypes):
        ran = []

        def config(*a, o=o, **kw):
            ran.append(dataclasses.replace(original(*a, **kw), **o))
            return ran[-1]
        attention.attention_config = config
        try:
            for dtype in dts:
                cache, tables = caches[dtype]
                k, v = cache.layer(1)
                case = {"batch": batch, "ctx": ctx, "rows": rows, "shape": shape, "dtype": dtype, **o}
                try:
                    ms = timed(lambda: attention.paged_attention(q, k, v, tables, qs, sl, d ** -0.5))
                except Exception as e:  # a configuration the kernel cannot take (shared memory, registers)
                    out.append({**case, "error": str(e).splitlines()[0][:200]})
                    continue
                nbytes = kv_bytes(dtype, batch, ctx, hkv, d)
                row = {**case, "config": dataclasses.asdict(ran[-1]), "ms": ms, "kv_gb_s": nbytes / ms / 1e6,
                       "hbm_share": nbytes / ms / 1e-3 / HBM_BYTES_S}
                out.append(row)
                print(json.dumps(row), flush=True)
        finally:
            attention.attention_config = original
    return out


def sweep() -> list[tuple[int, int, int, str, list[dict]]]:
    """The cases: (batch, context, query rows a sequence, shape, overrides)."""
    splits = [{}] + [{"num_splits": s} for s in (4, 8, 16, 32, 64)]
    stages = [{"num_stages": s} for s in (3, 4)]
    # k6_v4's decode takes 8 warps (4 spill); an older build (session 15) ran b8 in 0.84 ms at 4, 1.01 at 8 now
    warps = [{"num_warps": 4, "dtypes": ("k6_v4",)}]
    prefill = [{}, {"num_stages": 3}, {"num_warps": 8}, {"block_m": 128, "block_q": 128 // 8, "num_warps": 8},
               {"block_n": 128}, {"block_n": 32}]
    return [(batch, 16384, 1, "qwen3", splits + stages + warps) for batch in (8, 32)] + [
        (1, 4096, 4096, "qwen3", prefill),
        (1, 4096, 4096, "next", [{}, {"num_stages": 3}, {"num_warps": 4}, {"block_n": 64}])]


def dtype_list(text: str) -> list[str]:
    dtypes = [dt for dt in text.split(",") if dt]
    if not dtypes or any(dt not in DTYPES for dt in dtypes) or len(set(dtypes)) < len(dtypes):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of distinct {', '.join(DTYPES)}")
    return dtypes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--dtypes", type=dtype_list, default=["auto", "fp8"],
                    help=f"the caches timed, comma-separated, of {', '.join(DTYPES)} (default auto,fp8)")
    ap.add_argument("--dry-run", action="store_true", help="list the rows a run would time, and stop")
    ap.add_argument("--first-term", choices=sorted(FIRST_TERMS),
                    help="fp8's block-first term in the K logits replaced (`none`: left out, wrong values, what "
                         "the term costs; `gather`: taken by tl.gather, not a reshape; `reshape`: the kernel's "
                         "own), default configurations and 128-key prefill tiles only; run in a process of its "
                         "own (a kernel compiled before the patch keeps its cache key)")
    args = ap.parse_args()
    if args.first_term:
        cases = [(batch, 16384, 1, "qwen3", [{}]) for batch in (8, 32)] + [
            (1, 4096, 4096, "qwen3", [{}, {"block_n": 128}])]
    else:
        cases = sweep()
    if args.dry_run:
        n = 0
        for batch, ctx, rows, shape, overrides in cases:
            for o, dts in selected(overrides, args.dtypes):
                n += len(dts)
                print(json.dumps({"batch": batch, "ctx": ctx, "rows": rows, "shape": shape, "dtypes": dts, **o}))
        print(f"{n} rows")
        return 0
    if args.out is None:
        ap.error("--out is required (but with --dry-run)")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.first_term:
        kv_fp8.add_block_first = FIRST_TERMS[args.first_term]
    rows = []
    for case in cases:
        rows += run_case(*case, args.dtypes)
    name = f"sweep_attention_first_term_{args.first_term}" if args.first_term else "sweep_attention"
    (args.out / f"{name}.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
