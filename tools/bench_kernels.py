"""Triton kernel benchmarks on CUDA, each as a ratio to a ceiling measured in the same run.

    python tools/bench_kernels.py [--out DIR] [--only SECTION ...]   # DIR defaults to $OUT, else ./out

Writes DIR/bench_kernels.json (rewritten after every section, so a run cut short
keeps what it measured) and prints one line per figure. Synthetic data: random
bf16 weights and K/V at Qwen3-30B-A3B shapes (32 query / 4 KV heads x 128;
128 experts, top-8, I = 768, H = 2048); routing is a softmax top-8 of random
logits. Sections:

- ceilings: device-to-device copy (bytes read + written / time) and pinned
  host-to-device copy;
- attention: decode over 48 layers of distinct paged caches (one CUDA graph of
  48 calls), batch 1 and 32, contexts 1K and 4K: time per layer against KV
  bytes / copy bandwidth; plus a split-count sweep at batch 1;
- moe_vram: the fused MoE over 8 layers of distinct 128-expert slabs (one graph),
  batch 1 and 32: time per layer against the bytes of the distinct routed
  experts / copy bandwidth;
- moe_pinned: the same kernel with two layers of experts in pinned host memory
  read through raw addresses (`moe_ptr`): achieved bytes/s against the pinned
  host-to-device copy; beside it, the alternative of copying the routed experts
  into VRAM first (copy engine, needs the host to know the routing) then running
  the VRAM kernel;
- profile: per-kernel device time of one eager call of each op (CUDA profiler);
- moe_sweep: a few tile configurations at batch 1 and 32 (stops early past the
  time guard), to tune `moe_config`;
- linear: the skinny linear (`kernels/linear.py`) against torch's F.linear
  (cuBLAS; + a separate add for o_proj's residual) at T = 1, 4, 16 for q/k/v
  (2048 -> 5120), o_proj (4096 -> 2048, + residual) and the router (2048 ->
  128), each over distinct weight copies (8 layers, or twice the L2's bytes:
  the router's 0.5 MB would otherwise replay from L2) in one graph: time per
  layer against (weight + x + out (+ residual) bytes) / copy bandwidth; then a
  sweep of `LinearConfig`s beside `linear_config`'s pick (stops past the time
  guard).

`--only` runs the named sections (and the ceilings, which the others divide by).
Needs about 20 GB of device memory, 3 GB of pinned host memory, and about two
minutes on an H200 (mostly Triton compiles; `--only linear` alone about one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402

from tools.gpu_bench import timeit  # noqa: E402  (one timer for every device benchmark)

GB = 1e9
BLOCK = 16
HQ, HKV, HEAD_DIM, LAYERS = 32, 4, 128, 48
E, TOP_K, INTER, HIDDEN = 128, 8, 768, 2048
ROW_ELEMS = 3 * INTER * HIDDEN
TIME_GUARD_S = 95.0  # optional sections stop past this
SECTIONS = ("attention", "moe_vram", "moe_pinned", "profile", "moe_sweep", "linear")


def _sync() -> None:
    torch.cuda.synchronize()


def time_graph(fn, reps: int = 20) -> dict:
    """Capture `fn` (which may launch many kernels) once as a CUDA graph; time its replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles) off the capture, as torch recommends
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    _sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    out = timeit(graph.replay, "cuda", warmup=2, reps=reps)
    del graph
    return out


# -- ceilings ----------------------------------------------------------------------------------------


def ceilings() -> dict:
    n = 2 << 30
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), "cuda", warmup=3, reps=20)
    copy = {"bytes": n, "moved_bytes": 2 * n, **t, "bytes_per_s": 2 * n / t["median_s"]}
    del src, dst
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    t = timeit(lambda: dev.copy_(host, non_blocking=True), "cuda", warmup=2, reps=10)
    h2d = {"bytes": n, **t, "bytes_per_s": n / t["median_s"]}
    del host, dev
    return {"device_copy": copy, "pinned_h2d": h2d}


# -- attention ---------------------------------------------------------------------------------------


def _decode_batch(batch: int, ctx: int, layers: int, gen: torch.Generator):
    blocks = batch * -(-ctx // BLOCK)
    caches = [(torch.randn((blocks, 1, BLOCK, HKV, HEAD_DIM), generator=gen, device="cuda").bfloat16(),
               torch.randn((blocks, 1, BLOCK, HKV, HEAD_DIM), generator=gen, device="cuda").bfloat16())
              for _ in range(layers)]
    tables = torch.randperm(blocks, generator=gen, device="cuda").int().view(batch, -1)
    q = torch.randn((batch, HQ, HEAD_DIM), generator=gen, device="cuda").bfloat16()
    query_start = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return caches, tables, q, query_start, seq_lens


def attention_section(hbm: float, deadline: float) -> dict:
    from radianced.kernels import attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {"layers": LAYERS, "cases": []}
    for batch, ctx in ((1, 1024), (1, 1100), (32, 1024), (1, 4096), (32, 4096)):
        caches, tables, q, qs, sl = _decode_batch(batch, ctx, LAYERS, gen)
        cfg = attention.attention_config(batch, batch, HQ, HKV, HEAD_DIM, q.device)

        def step(caches=caches, tables=tables, q=q, qs=qs, sl=sl):
            for kc, vc in caches:
                attention.paged_attention(q, kc, vc, tables, qs, sl, HEAD_DIM ** -0.5)

        t = time_graph(step)
        kv_bytes = batch * ctx * HKV * HEAD_DIM * 2 * 2  # K and V, bf16, per layer
        per_layer = t["median_s"] / LAYERS
        floor = kv_bytes / hbm
        case = {"batch": batch, "ctx": ctx, "num_splits": cfg.num_splits, "kv_bytes_per_layer": kv_bytes,
                "s_per_layer": per_layer, "floor_s_per_layer": floor, "ratio": floor / per_layer,
                "achieved_bytes_per_s": kv_bytes / per_layer, **{f"graph_{k}": v for k, v in t.items()}}
        out["cases"].append(case)
        print(f"attention decode b{batch} ctx{ctx} splits {cfg.num_splits}: {per_layer * 1e6:.1f} us/layer, "
              f"floor {floor * 1e6:.1f} us, {floor / per_layer:.0%} of copy bandwidth", flush=True)
        if batch == 1 and ctx in (1024, 1100) and time.monotonic() < deadline:
            sweep = []
            for splits in (1, 4, 8, 16, 32, 64):
                def one(splits=splits, caches=caches, tables=tables, q=q, qs=qs, sl=sl):
                    for kc, vc in caches:
                        attention.paged_attention(q, kc, vc, tables, qs, sl, HEAD_DIM ** -0.5, num_splits=splits)
                ts = time_graph(one)
                sweep.append({"num_splits": splits, "s_per_layer": ts["median_s"] / LAYERS,
                              "ratio": floor / (ts["median_s"] / LAYERS)})
            out[f"split_sweep_b1_ctx{ctx}"] = sweep
            print(f"  split sweep b1 ctx{ctx}: " + ", ".join(
                f"{s['num_splits']}: {s['s_per_layer'] * 1e6:.1f} us" for s in sweep), flush=True)
        del caches, tables, q
        torch.cuda.empty_cache()
    return out


# -- MoE ---------------------------------------------------------------------------------------------


def _routing(batch: int, layers: int, gen: torch.Generator):
    xs, ids, ws, distinct = [], [], [], []
    for _ in range(layers):
        xs.append(torch.randn((batch, HIDDEN), generator=gen, device="cuda").bfloat16())
        w, i = torch.randn((batch, E), generator=gen, device="cuda").softmax(-1).topk(TOP_K, dim=-1)
        ids.append(i)
        ws.append((w / w.sum(-1, keepdim=True)).bfloat16())
        distinct.append(int(torch.unique(i).numel()))  # host read, before timing
    return xs, ids, ws, distinct


def moe_vram_section(hbm: float, layers: int = 8) -> dict:
    from radianced.kernels import moe

    gen = torch.Generator(device="cuda").manual_seed(1)
    slab = torch.empty((layers * E, ROW_ELEMS), dtype=torch.bfloat16, device="cuda")
    for r in range(0, slab.shape[0], E):
        slab[r: r + E].normal_(0, HIDDEN ** -0.5, generator=gen)
    tables = [torch.arange(l * E, (l + 1) * E, device="cuda") for l in range(layers)]
    row_bytes = ROW_ELEMS * 2
    out = {"layers": layers, "row_bytes": row_bytes, "cases": []}
    for batch in (1, 32):
        xs, ids, ws, distinct = _routing(batch, layers, gen)
        for deterministic in (False, True):
            def step(xs=xs, ids=ids, ws=ws, det=deterministic):
                for l in range(layers):
                    moe.moe(xs[l], ids[l], ws[l], tables[l], slab, INTER, deterministic=det)

            t = time_graph(step)
            weight_bytes = sum(distinct) * row_bytes
            floor = weight_bytes / hbm
            case = {"batch": batch, "deterministic": deterministic, "distinct_experts_per_layer": distinct,
                    "weight_bytes": weight_bytes, "s_per_layer": t["median_s"] / layers,
                    "floor_s_per_layer": floor / layers, "ratio": floor / t["median_s"],
                    "achieved_bytes_per_s": weight_bytes / t["median_s"],
                    "config": moe.moe_config(batch, torch.bfloat16).__dict__,
                    **{f"graph_{k}": v for k, v in t.items()}}
            out["cases"].append(case)
            print(f"moe vram b{batch}{' deterministic' if deterministic else ''}: "
                  f"{case['s_per_layer'] * 1e6:.1f} us/layer, {case['achieved_bytes_per_s'] / GB:.0f} GB/s, "
                  f"{case['ratio']:.0%} of copy bandwidth ({sum(distinct) / layers:.1f} experts/layer)", flush=True)
        e = moe.moe(xs[0], ids[0], ws[0], tables[0], slab, INTER).float()
        r = moe.moe(xs[0], ids[0], ws[0], tables[0], slab, INTER, deterministic=True).float()
        out[f"b{batch}_atomic_vs_deterministic_rel"] = float((e - r).abs().max() / r.abs().max())
    del slab
    torch.cuda.empty_cache()
    return out


def moe_pinned_section(pinned_bw: float, layers: int = 2) -> dict:
    from radianced.kernels import moe

    gen = torch.Generator(device="cuda").manual_seed(2)
    row_bytes = ROW_ELEMS * 2
    host = torch.empty((layers * E, ROW_ELEMS), dtype=torch.bfloat16, pin_memory=True)
    dev = torch.empty((E, ROW_ELEMS), dtype=torch.bfloat16, device="cuda")
    for r in range(0, host.shape[0], E):
        dev.normal_(0, HIDDEN ** -0.5, generator=gen)
        host[r: r + E].copy_(dev)
    del dev
    ptrs = [(host.data_ptr() + torch.arange(l * E, (l + 1) * E) * row_bytes).cuda() for l in range(layers)]
    mapped = _device_pointer(host)
    out = {"layers": layers, "row_bytes": row_bytes, "device_pointer_equals_host_pointer": mapped, "cases": []}
    staging = torch.empty((E, ROW_ELEMS), dtype=torch.bfloat16, device="cuda")
    for batch in (1, 32):
        xs, ids, ws, distinct = _routing(batch, layers, gen)

        def step(xs=xs, ids=ids, ws=ws):
            for l in range(layers):
                moe.moe_ptr(xs[l], ids[l], ws[l], ptrs[l], INTER)

        t = time_graph(step, reps=5)
        weight_bytes = sum(distinct) * row_bytes
        achieved = weight_bytes / t["median_s"]

        # the alternative: the host knows the routing, the copy engine brings the experts, the VRAM kernel runs
        rows = [torch.unique(ids[l]).tolist() for l in range(layers)]

        def copy_then_vram(xs=xs, ids=ids, ws=ws, rows=rows):
            for l in range(layers):
                table = torch.zeros(E, dtype=torch.int64)
                for slot, e in enumerate(rows[l]):
                    staging[slot].copy_(host[l * E + e], non_blocking=True)
                    table[e] = slot
                moe.moe(xs[l], ids[l], ws[l], table.to("cuda", non_blocking=True), staging, INTER)

        tc = timeit(copy_then_vram, "cuda", warmup=1, reps=3)
        check_a = moe.moe_ptr(xs[0], ids[0], ws[0], ptrs[0], INTER, deterministic=True)
        table0 = torch.zeros(E, dtype=torch.int64)
        for slot, e in enumerate(rows[0]):
            staging[slot].copy_(host[e])
            table0[e] = slot
        check_b = moe.moe(xs[0], ids[0], ws[0], table0.cuda(), staging, INTER, deterministic=True)
        case = {"batch": batch, "distinct_experts_per_layer": distinct, "weight_bytes": weight_bytes,
                "s_per_layer": t["median_s"] / layers, "achieved_bytes_per_s": achieved,
                "ratio_to_pinned_h2d": achieved / pinned_bw,
                "copy_then_vram_s_per_layer": tc["median_s"] / layers,
                "copy_then_vram_bytes_per_s": weight_bytes / tc["median_s"],
                "bitwise_equal_to_vram": bool(torch.equal(check_a, check_b)),
                **{f"graph_{k}": v for k, v in t.items()}}
        out["cases"].append(case)
        print(f"moe pinned b{batch}: {case['s_per_layer'] * 1e3:.2f} ms/layer, {achieved / GB:.1f} GB/s = "
              f"{case['ratio_to_pinned_h2d']:.0%} of pinned H2D; copy-then-VRAM "
              f"{case['copy_then_vram_s_per_layer'] * 1e3:.2f} ms/layer; same bits as VRAM: "
              f"{case['bitwise_equal_to_vram']}", flush=True)
    del host, staging
    return out


def _device_pointer(host: torch.Tensor) -> bool | None:
    """True if cudaHostGetDevicePointer maps the pinned tensor to its own address (unified addressing)."""
    try:
        from cuda.bindings import runtime as rt  # cuda-python, on the device image
    except ImportError:
        try:
            from cuda import cudart as rt  # older cuda-python spelling
        except ImportError:
            return None
    err, ptr = rt.cudaHostGetDevicePointer(host.data_ptr(), 0)
    if int(err) != 0:
        return None
    return int(ptr) == host.data_ptr()


def moe_sweep_section(hbm: float, deadline: float, layers: int = 4) -> dict:
    from radianced.kernels import moe

    gen = torch.Generator(device="cuda").manual_seed(3)
    slab = torch.empty((layers * E, ROW_ELEMS), dtype=torch.bfloat16, device="cuda").normal_(0, 0.02, generator=gen)
    tables = [torch.arange(l * E, (l + 1) * E, device="cuda") for l in range(layers)]
    variants = [  # (block_n_up, block_k_up, block_n_down, block_k_down, warps, stages)
        (32, 128, 64, 128, 4, 4), (64, 128, 64, 128, 4, 4), (16, 128, 32, 128, 4, 4),
        (32, 256, 32, 256, 4, 3), (32, 128, 64, 128, 8, 4), (64, 64, 128, 64, 4, 5),
    ]
    out = {"layers": layers, "runs": []}
    for batch in (1, 32):
        xs, ids, ws, distinct = _routing(batch, layers, gen)
        weight_bytes = sum(distinct) * ROW_ELEMS * 2
        block_m = moe.moe_config(batch, torch.bfloat16).block_m
        for v in variants:
            if time.monotonic() > deadline:
                out["stopped_at_time_guard"] = True
                return out
            cfg = moe.MoEConfig(block_m, *v)

            def step(xs=xs, ids=ids, ws=ws, cfg=cfg):
                for l in range(layers):
                    moe._launch_moe(xs[l], ids[l], ws[l].reshape(-1), tables[l], slab, slab.stride(0), False,
                                    INTER, False, moe.extent_layout(None, INTER, HIDDEN), cfg=cfg)

            t = time_graph(step, reps=10)
            run = {"batch": batch, "config": cfg.__dict__, "s_per_layer": t["median_s"] / layers,
                   "ratio": weight_bytes / hbm / t["median_s"]}
            out["runs"].append(run)
            print(f"  moe sweep b{batch} {v}: {run['s_per_layer'] * 1e6:.1f} us/layer, {run['ratio']:.0%}", flush=True)
    del slab
    torch.cuda.empty_cache()
    return out


# -- skinny linear -----------------------------------------------------------------------------------

LINEAR_SHAPES = {  # name: (N, K, residual): Qwen3-30B-A3B's decode projections, bf16, no bias (as Qwen3)
    "qkv": (HQ * HEAD_DIM + 2 * HKV * HEAD_DIM, HIDDEN, False),
    "o_proj": (HIDDEN, HQ * HEAD_DIM, True),
    "router": (E, HIDDEN, False),
}
LINEAR_VARIANTS = (  # (block_n, block_k, num_warps, num_stages[, kind]) swept beside linear_config's own pick
    (16, 256, 4, 4), (32, 256, 4, 4), (16, 512, 4, 3), (64, 256, 4, 3), (32, 512, 4, 3), (64, 512, 8, 3),
    (1, 0, 4, 1, "gemv"), (2, 0, 4, 1, "gemv"), (4, 0, 4, 1, "gemv"), (4, 0, 8, 1, "gemv"), (8, 0, 8, 1, "gemv"),
    (2, 0, 8, 1, "gemv"),
)


def _us(run: dict) -> str:
    return f"{run['s_per_layer'] * 1e6:.1f} us ({run['ratio']:.0%} of copy bandwidth)"


def linear_section(hbm: float, deadline: float) -> dict:
    """The skinny linear against torch's F.linear (+ the residual add) at T = 1, 4, 16, each timed over
    distinct weight copies (8 layers, or enough to fill twice the L2) in one graph, so every replay
    streams the weights from HBM; then the config sweep (stops past the time guard)."""
    import torch.nn.functional as F

    from radianced.kernels import linear

    gen = torch.Generator(device="cuda").manual_seed(5)
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    out = {"l2_bytes": l2, "cases": []}
    for name, (n, k, with_residual) in LINEAR_SHAPES.items():
        weight_bytes = n * k * 2
        layers = max(8, -(-2 * l2 // weight_bytes))
        ws = torch.empty((layers, n, k), dtype=torch.bfloat16, device="cuda").normal_(0, k ** -0.5, generator=gen)
        for t in (1, 4, 16):
            default = linear.linear_config(t, n, k, torch.bfloat16)  # None: torch's F.linear
            xs = torch.randn((layers, t, k), generator=gen, device="cuda").bfloat16()
            rs = torch.randn((layers, t, n), generator=gen, device="cuda").bfloat16() if with_residual else None
            moved = weight_bytes + (t * k + (2 if with_residual else 1) * t * n) * 2  # + x, out (+ residual)
            floor = moved / hbm

            def timed(fn, xs=xs, ws=ws, rs=rs) -> dict:
                def step():
                    for l in range(layers):
                        fn(xs[l], ws[l], None if rs is None else rs[l])
                s = time_graph(step)["median_s"] / layers
                return {"s_per_layer": s, "achieved_bytes_per_s": moved / s, "ratio": floor / s}

            case = {"shape": name, "n": n, "k": k, "residual": with_residual, "t": t, "layers": layers,
                    "bytes_per_layer": moved, "floor_s_per_layer": floor,
                    "torch": timed(lambda x, w, r: F.linear(x, w) if r is None else r + F.linear(x, w)),
                    "pick": {"config": None if default is None else default.__dict__,
                             **timed(lambda x, w, r: linear.linear(x, w, residual=r))}}
            got = linear.linear(xs[0], ws[0], residual=None if rs is None else rs[0]).float()
            want = F.linear(xs[0].float(), ws[0].float()) + (0 if rs is None else rs[0].float())
            case["rel_err_vs_fp32"] = float((got - want).abs().max() / want.abs().max())
            runs = []
            for v in LINEAR_VARIANTS:
                if time.monotonic() > deadline:
                    out["stopped_at_time_guard"] = True
                    break
                cfg = linear.LinearConfig(*v)
                try:
                    runs.append({"config": cfg.__dict__,
                                 **timed(lambda x, w, r, cfg=cfg: linear.linear(x, w, residual=r, cfg=cfg))})
                except Exception as exc:  # a variant the device cannot hold (shared memory) is a result too
                    runs.append({"config": cfg.__dict__, "error": f"{type(exc).__name__}: {exc}"[:300]})
            case["sweep"] = runs
            timed_runs = [r for r in runs if "s_per_layer" in r]
            if timed_runs:
                case["best"] = min(timed_runs, key=lambda r: r["s_per_layer"])
            out["cases"].append(case)
            line = (f"linear {name} {k}->{n} t{t}{' +residual' if with_residual else ''}: floor {floor * 1e6:.1f} us, "
                    f"torch {_us(case['torch'])}, linear_config's pick {_us(case['pick'])}")
            if "best" in case:
                line += f"; best of {len(timed_runs)} {tuple(case['best']['config'].values())} {_us(case['best'])}"
            print(line, flush=True)
        del ws
        torch.cuda.empty_cache()
    return out


def profile_section() -> dict:
    """Per-kernel device time (CUDA profiler) of one eager call each: where a layer's time goes."""
    from torch.profiler import ProfilerActivity, profile

    from radianced.kernels import attention, moe

    gen = torch.Generator(device="cuda").manual_seed(4)
    slab = torch.empty((E, ROW_ELEMS), dtype=torch.bfloat16, device="cuda").normal_(0, 0.02, generator=gen)
    table = torch.arange(E, device="cuda")
    cases = {}
    for batch in (1, 32):
        xs, ids, ws, _ = _routing(batch, 1, gen)
        cases[f"moe_b{batch}"] = lambda x=xs[0], i=ids[0], w=ws[0]: moe.moe(x, i, w, table, slab, INTER)
        caches, tables, q, qs, sl = _decode_batch(batch, 1024, 1, gen)
        kc, vc = caches[0]
        cases[f"attention_b{batch}_ctx1024"] = (
            lambda q=q, kc=kc, vc=vc, t=tables, qs=qs, sl=sl: attention.paged_attention(q, kc, vc, t, qs, sl, 0.1))
    for batch in (32, 64):  # the grouping alone (fused counting sort); chunk sizes and warps did not matter
        ids = _routing(batch, 1, gen)[1][0]
        cases[f"group_b{batch}"] = (
            lambda ids=ids, bm=moe.moe_config(batch, torch.bfloat16).block_m: moe.group_by_expert(ids, E, bm))
    out = {}
    for name, fn in cases.items():
        fn()
        _sync()
        reps = 5
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            _sync()
        kernels = []
        for ev in prof.key_averages():
            total = getattr(ev, "device_time_total", None)
            if total is None:
                total = getattr(ev, "cuda_time_total", 0.0)
            if total:
                kernels.append({"kernel": ev.key[:90], "us_per_call": total / reps,
                                "launches_per_call": ev.count / reps})
        kernels.sort(key=lambda k: -k["us_per_call"])
        out[name] = kernels
        print(f"profile {name}: " + "; ".join(f"{k['kernel'][:40]} {k['us_per_call']:.1f} us" for k in kernels[:8]),
              flush=True)
    return out


# -- driver ------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--only", action="append", choices=SECTIONS,
                   help="run only this section (repeatable; the ceilings always run)")
    args = p.parse_args(argv)
    wanted = set(args.only or SECTIONS)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench_kernels.json"
    if not torch.cuda.is_available():
        print("bench_kernels: needs CUDA; nothing measured")
        path.write_text(json.dumps({"skipped": "needs CUDA"}, indent=1))
        return 0
    import triton

    start = time.monotonic()
    deadline = start + TIME_GUARD_S
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                     "commit": os.environ.get("RADIANCED_COMMIT"), "synthetic": True, "sections": {}}

    def section(name, fn, *a):
        if name != "ceilings" and name not in wanted:
            return None
        t0 = time.monotonic()
        try:
            results["sections"][name] = {"ok": True, **fn(*a)}
        except Exception as exc:  # one failing section must not lose the others
            traceback.print_exc()
            results["sections"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        results["sections"][name]["seconds"] = time.monotonic() - t0
        path.write_text(json.dumps(results, indent=1, default=str))
        torch.cuda.empty_cache()
        return results["sections"][name]

    ceil = section("ceilings", ceilings)
    hbm = ceil["device_copy"]["bytes_per_s"] if ceil["ok"] else 4.2e12
    h2d = ceil["pinned_h2d"]["bytes_per_s"] if ceil["ok"] else 5.5e10
    if ceil["ok"]:
        print(f"device copy {hbm / 1e12:.2f} TB/s (read+write), pinned H2D {h2d / GB:.1f} GB/s", flush=True)
    section("attention", attention_section, hbm, deadline)
    section("moe_vram", moe_vram_section, hbm)
    section("moe_pinned", moe_pinned_section, h2d)
    section("profile", profile_section)
    section("moe_sweep", moe_sweep_section, hbm, deadline)
    section("linear", linear_section, hbm, deadline)
    results["seconds"] = time.monotonic() - start
    path.write_text(json.dumps(results, indent=1, default=str))
    print(f"bench_kernels: {results['seconds']:.0f} s, wrote {path}")
    return 0 if all(s["ok"] for s in results["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
