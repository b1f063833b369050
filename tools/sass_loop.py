"""The attention kernel's key loop as the H200 runs it, read on a machine without a GPU (issues 21, 20).

    python tools/sass_loop.py [--kv-dtype auto fp8 ...] [--prefill] [--heads 32,4,128] [--config num_warps=8 ...]
    python tools/sass_loop.py --moe bf16 q8_0 q4_0 fp8_b128 [--tokens 32]

Builds `_paged_attention_kernel` for sm_90 (tests/kernels/hopper_compile.py: Triton's compiler and
the wheel's ptxas, nothing launched), disassembles it (the wheel's nvdisasm) and reads the loop over
key tiles (the one with the dots): its instructions and their opcodes. Where a kernel is bound by
its instructions, not its bytes (fp8's decode at 16K on the H200: 15-17% of HBM against auto's
44-57%, tools/sweep_attention.py), this counts what a change to the loop saves before a device
measures it. bf16 activations, Qwen3-30B-A3B's heads by default. With --moe, the routed MoE's
gate/up and down kernels over bf16 or compact experts (issue 20): their K loops, and the
instructions a dot (tensor-core work against the rest).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-dtype", nargs="+", default=["auto", "fp8"])
    ap.add_argument("--prefill", action="store_true", help="a prefill step's kernel (default: the fused decode's)")
    ap.add_argument("--heads", default="32,4,128", help="query heads, KV heads, head dim")
    ap.add_argument("--config", nargs="*", default=[], metavar="FIELD=N",
                    help="attention_config's fields overridden, e.g. num_warps=8 block_n=32")
    ap.add_argument("--moe", nargs="*", metavar="FORMAT",
                    help="the routed MoE's kernels instead, over experts of these formats (bf16, q8_0, q4_0, "
                         "q4_1, fp8_b128, q4_0+q8_0) at --tokens rows, Qwen3-30B-A3B's widths")
    ap.add_argument("--tokens", type=int, default=32, help="with --moe: the step's tokens (default 32)")
    args = ap.parse_args(argv)
    import torch

    from radianced.kernels import attention
    from tests.kernels.hopper_compile import attention_step, compile_only, disassemble, loop_mix, moe_step

    built = compile_only()
    if args.moe:
        for fmt in args.moe:
            before = len(built)
            moe_step(fmt, args.tokens)
            for name, kernel in built[before:]:
                if name in ("_moe_gate_up_kernel", "_moe_down_kernel"):
                    ops = loop_mix(disassemble(kernel.asm["cubin"]))["ops"]
                    dots = sum(n for op, n in ops.items() if "MMA" in op)
                    top = ", ".join(f"{op} {n}" for op, n in list(ops.items())[:12])
                    print(f"{fmt:9s} {name:20s} T={args.tokens}: {sum(ops.values())} instructions a K step, "
                          f"{dots} dots ({sum(ops.values()) / max(dots, 1):.1f} a dot), "
                          f"{ops.get('LDL', 0) + ops.get('STL', 0)} spilled; {top}", flush=True)
        return 0
    if args.config:
        overrides = {k: int(v) for k, v in (c.split("=") for c in args.config)}
        chosen = attention.attention_config
        attention.attention_config = lambda *a, **kw: dataclasses.replace(chosen(*a, **kw), **overrides)

    heads = tuple(int(x) for x in args.heads.split(","))
    for kv_dtype in args.kv_dtype:
        attention_step(kv_dtype, torch.bfloat16, not args.prefill, heads, contexts=(120, 120), prefill=40)
        kernel = next(k for name, k in reversed(built) if name == "_paged_attention_kernel")
        mix = loop_mix(disassemble(kernel.asm["cubin"]))
        top = ", ".join(f"{op} {n}" for op, n in list(mix["ops"].items())[:14])
        print(f"{kv_dtype:7s} {'prefill' if args.prefill else 'decode'}: {mix['instructions']} instructions a key "
              f"tile; {top}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
