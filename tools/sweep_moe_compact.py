"""The routed MoE over bf16 and GGUF experts on the card, per step size and launch config (issue 20).

    python tools/sweep_moe_compact.py --out OUT [--shapes next q30] [--formats bf16 q4_0 q8_0]
                                      [--tokens 1 4 8 17 32] [--layers 8]

For each shape (Qwen3-Next-80B-A3B's experts: E = 512, k = 10, H = 2048, I = 512; Qwen3-30B-A3B's: 128,
8, 2048, 768), format and step size T, times `moe` (gate/up and down launches, and the grouping where a
config sorts) over `--layers` layers of distinct experts (so no layer finds its experts in the 60 MB L2),
captured in one CUDA graph, under `moe_config`'s choice and, for GGUF experts, the few-rows path's variants
(columns a program, K step, warps) and the tensor-core tiles. Each row: us a layer, and the experts' bytes
a layer (each distinct expert's extent once) over that time as a share of the device copy rate measured
in the same run (bytes read + written / time of a 1 GiB device-to-device copy). Weights are random bytes:
the time does not depend on their values. Writes OUT/sweep_moe_compact.json (after every shape) and
prints one line a row, the chosen config marked `*`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tools.bench_kernels import time_graph  # noqa: E402
from tools.gpu_bench import timeit  # noqa: E402

SHAPES = {"next": (512, 10, 2048, 512), "q30": (128, 8, 2048, 768)}  # E, k, H, I
FMA_VARIANTS = [  # (columns a program, K step, warps), one assignment a tile
    (16, 256, 4), (32, 256, 4), (64, 256, 4), (16, 128, 4), (32, 128, 4), (16, 256, 2), (16, 512, 4),
]


def copy_rate() -> float:
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), "cuda", warmup=3, reps=10)
    return 2 * n / t["median_s"]


def sweep_shape(name: str, formats, tokens, layers: int, hbm: float) -> list[dict]:
    from radianced.kernels import moe

    experts, top_k, hidden, inter = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for fmt in formats:
        layout = moe.extent_layout(None if fmt == "bf16" else fmt, inter, hidden)
        width = layout.size if fmt == "bf16" else (layout.size + 15) // 16 * 16
        if fmt == "bf16":
            slab = torch.empty((layers * experts, width), dtype=torch.bfloat16, device="cuda").normal_(0, 0.02)
        else:
            slab = torch.randint(0, 256, (layers * experts, width), dtype=torch.uint8, device="cuda", generator=gen)
            # fp16 scales of random bits may be NaN or inf; the time does not depend on them
        extent_bytes = layout.size * (2 if fmt == "bf16" else 1)
        tables = [torch.arange(l * experts, (l + 1) * experts, device="cuda") for l in range(layers)]
        for t in tokens:
            xs = [torch.randn((t, hidden), dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(layers)]
            ids = [torch.rand((t, experts), device="cuda", generator=gen).topk(top_k, dim=-1).indices
                   for _ in range(layers)]
            ws = [torch.full((t, top_k), 1.0 / top_k, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
            distinct = sum(int(i.unique().numel()) for i in ids) / layers
            chosen = moe.moe_config(t, torch.bfloat16, layout.gate_up, layout.down, top_k, experts)
            configs = [("chosen", chosen)]
            if fmt != "bf16":
                for bn, bk, warps in FMA_VARIANTS:
                    configs.append((f"fma n{bn} k{bk} w{warps}", moe.MoEConfig(1, bn, bk, bn, bk, warps, 1, fma=True)))
                # asked without the routing, moe_config gives the tensor-core tiles
                configs.append(("tensor cores", moe.moe_config(t, torch.bfloat16, layout.gate_up, layout.down)))
            for label, cfg in configs:
                def step(cfg=cfg, slab=slab):
                    for l in range(layers):
                        moe._launch_moe(xs[l], ids[l], ws[l].reshape(-1), tables[l], slab, slab.stride(0), False,
                                        inter, False, layout, cfg=cfg)
                try:
                    s = time_graph(step, reps=10)["median_s"] / layers
                except Exception as e:  # noqa: BLE001  (a config that does not compile: recorded, the sweep goes on)
                    rows.append({"shape": name, "format": fmt, "tokens": t, "label": label, "error": repr(e)[:300]})
                    print(f"{name} {fmt:5s} T={t:3d} {label:24s} error {repr(e)[:120]}", flush=True)
                    continue
                row = {"shape": name, "format": fmt, "tokens": t, "label": label, "config": dataclasses.asdict(cfg),
                       "us_per_layer": s * 1e6, "distinct_experts": distinct,
                       "bytes_share_of_copy": distinct * extent_bytes / s / hbm}
                rows.append(row)
                mark = "*" if label == "chosen" else " "
                print(f"{name} {fmt:5s} T={t:3d} {mark}{label:24s} {s * 1e6:8.1f} us/layer  "
                      f"{row['bytes_share_of_copy']:6.1%} of copy  ({distinct:.0f} experts)", flush=True)
        del slab
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="+", default=["next", "q30"], choices=sorted(SHAPES))
    ap.add_argument("--formats", nargs="+", default=["bf16", "q4_0", "q8_0"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 8, 17, 32])
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_moe_compact: needs CUDA", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hbm = copy_rate()
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "copy_bytes_per_s": hbm, "rows": []}
    print(f"device copy {hbm / 1e9:.0f} GB/s", flush=True)
    for name in args.shapes:
        result["rows"] += sweep_shape(name, args.formats, args.tokens, args.layers, hbm)
        (out / "sweep_moe_compact.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
