"""What the L2 prefetch of o_proj's weight buys: a b1 decode layer's attention half, kernel by kernel.

    python tools/bench_prefetch.py [--out DIR] [--layers 8] [--reps 50]

Qwen3-30B-A3B shapes, bf16, a 1,024-token context: per layer the q/k/v gemv
(with the input norm), the decode attention launch (qk-norm, RoPE, KV write,
split keys) and its merge, and o_proj's gemv with the residual, over `--layers`
layers of distinct weights (302 MB at 8: every layer's weights are cold, as in
the model, where 75 MB of experts stream between two layers' attentions). The
chain is captured in one CUDA graph per prefetch mode (kernels/prefetch.py:
RADIANCED_L2_PREFETCH 0 off, 1 bulk, 2 lines), replayed `--reps` times in
interleaved rounds; printed: the replay time per layer, and each kernel's device
time per layer from the CUDA profiler. Writes DIR/bench_prefetch.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

HQ, HKV, D, HIDDEN, CTX, BLOCK = 32, 4, 128, 2048, 1024, 16


def _rand(*shape, scale=1.0):
    return (torch.randn(shape, device="cuda") * scale).to(torch.bfloat16)


def build(layers: int):
    """Per layer: weights, norm weights and a paged KV cache holding CTX - 1 keys; the inputs."""
    blocks = CTX // BLOCK + 1
    out = []
    for _ in range(layers):
        kc = _rand(1, blocks, BLOCK, HKV, D)
        vc = _rand(1, blocks, BLOCK, HKV, D)
        out.append(dict(wqkv=_rand((HQ + 2 * HKV) * D, HIDDEN, scale=HIDDEN ** -0.5),
                        wo=_rand(HIDDEN, HQ * D, scale=(HQ * D) ** -0.5), norm=_rand(HIDDEN), qk=_rand(D, scale=0.2),
                        kc=kc, vc=vc))
    bt = torch.arange(blocks, dtype=torch.int32, device="cuda").reshape(1, blocks)
    last = CTX - 1
    inputs = dict(x=_rand(1, HIDDEN), bt=bt, qs=torch.tensor([0, 1], device="cuda"),
                  sl=torch.tensor([CTX], device="cuda"), slots=torch.tensor([last], device="cuda"),
                  pos=torch.tensor([last], device="cuda"))
    return out, inputs


def chain(weights, inp):
    from radianced.kernels import attention, linear, reference
    inv_freq = reference.rotary_inv_freq(D, 1e6, "cuda")
    x = inp["x"]
    for w in weights:
        qkv = linear.linear(x, w["wqkv"], norm=(w["norm"], 1e-6, False))
        q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
        o = attention.rotary_paged_attention(q.reshape(1, HQ, D), k.reshape(1, HKV, D), v.reshape(1, HKV, D),
                                             inp["pos"], inv_freq, w["kc"], w["vc"], inp["slots"], inp["bt"],
                                             inp["qs"], inp["sl"], D ** -0.5, q_weight=w["qk"], k_weight=w["qk"],
                                             decode=True, warm=w["wo"]).reshape(1, HQ * D)
        x = linear.linear(o, w["wo"], residual=x)
    return x


def capture(mode: str, weights, inp) -> torch.cuda.CUDAGraph:
    from radianced.kernels import prefetch
    os.environ["RADIANCED_L2_PREFETCH"] = mode
    prefetch._mode.cache_clear()
    chain(weights, inp)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(weights, inp)
    prefetch._mode.cache_clear()
    return graph


def kernels(graph, reps: int, layers: int) -> dict[str, float]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    us: dict = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == DeviceType.CUDA:
            us[ev.name] += ev.time_range.elapsed_us() / reps / layers
    return dict(us)


def gemv_cold_hot(weights, inp, reps: int) -> dict[str, float]:
    """us per o_proj gemv: over the layers' distinct weights (cold: HBM), and one layer's weight
    again and again (hot: its 16.8 MB stays in L2), each a captured chain of gemvs."""
    from radianced.kernels import linear
    o = _rand(1, HQ * D)
    out = {}
    for name, ws in (("cold", [w["wo"] for w in weights]), ("hot", [weights[0]["wo"]] * len(weights))):
        def run(ws=ws):
            for w in ws:
                linear.linear(o, w, residual=inp["x"])
        run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        out[name] = start.elapsed_time(end) * 1e3 / reps / len(ws)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="0,1,2")
    args = ap.parse_args()
    weights, inp = build(args.layers)
    graphs = {m: capture(m, weights, inp) for m in args.modes.split(",")}
    times: dict = defaultdict(list)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(args.rounds):
        for m, g in graphs.items():
            g.replay()
            start.record()
            for _ in range(args.reps):
                g.replay()
            end.record()
            end.synchronize()
            times[m].append(start.elapsed_time(end) * 1e3 / args.reps / args.layers)
    result = {"device": torch.cuda.get_device_name(), "layers": args.layers, "reps": args.reps, "modes": {},
              "o_proj_gemv_us": gemv_cold_hot(weights, inp, args.reps)}
    print("o_proj gemv alone: " + ", ".join(f"{k} {v:.2f} us" for k, v in result["o_proj_gemv_us"].items()))
    for m, g in graphs.items():
        per_kernel = kernels(g, args.reps, args.layers)
        result["modes"][m] = {"us_per_layer": sorted(times[m]), "kernels_us_per_layer": per_kernel}
        print(f"mode {m}: {min(times[m]):.2f} us per layer (rounds {', '.join(f'{t:.2f}' for t in times[m])})")
        for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
            print(f"    {us:7.2f} us  {name[:80]}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_prefetch.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
