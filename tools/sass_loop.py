"""The attention kernel's key loop as the H200 runs it, read on a machine without a GPU (issue 21).

    python tools/sass_loop.py [--kv-dtype auto fp8 ...] [--prefill] [--heads 32,4,128]

Builds `_paged_attention_kernel` for sm_90 (tests/kernels/hopper_compile.py: Triton's compiler and
the wheel's ptxas, nothing launched), disassembles it (Triton's `get_sass`: the wheel's
nvdisasm) and reads the loop over key tiles (the one with the dots): its instructions, the stall cycles
the compiler scheduled between them (a lower bound on a warp's cycles a tile), and the opcodes.
Where a kernel is bound by its instructions, not its bytes (fp8's decode at 16K on the H200:
15-17% of HBM against auto's 44-57%, tools/sweep_attention.py), this counts what a change to the
loop saves before a device measures it. bf16 activations, Qwen3-30B-A3B's heads by default.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def loop_mix(sass: str) -> dict:
    """The loop (a branch back to a label above it) of `sass` with the most dot instructions, the longest of
    those: {instructions, stall_cycles, ops}."""
    labels, body = {}, []  # label -> index of the instruction after it; (control, text) per instruction
    for line in sass.splitlines():
        if m := re.match(r"^\s*(\.?L\w+):", line):
            labels[m[1]] = len(body)
        elif m := re.match(r"^([0-9a-fA-F-]{2}:[^\t]+)\t(.*)$", line):
            body.append((m[1], m[2]))
    loops = [(labels[m[1]], i) for i, (_, text) in enumerate(body)
             if (m := re.search(r"BRA\s+(\.?L\w+)", text)) and labels.get(m[1], i + 1) <= i]
    if not loops:
        return {"instructions": 0, "stall_cycles": 0, "ops": {}}
    def dots(r):  # the key loop holds the dots (HMMA, or WGMMA where Triton issues Hopper's)
        return sum("MMA" in text for _, text in body[r[0]:r[1] + 1]), r[1] - r[0]

    lo, hi = max(loops, key=dots)
    inside = body[lo:hi + 1]
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0] for _, text in inside)
    return {"instructions": len(inside), "stall_cycles": sum(int(c.rsplit(":", 1)[1], 16) for c, _ in inside),
            "ops": dict(ops.most_common())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-dtype", nargs="+", default=["auto", "fp8"])
    ap.add_argument("--prefill", action="store_true", help="a prefill step's kernel (default: the fused decode's)")
    ap.add_argument("--heads", default="32,4,128", help="query heads, KV heads, head dim")
    args = ap.parse_args(argv)
    from tests.kernels.hopper_compile import attention_step, compile_only

    built = compile_only()
    import torch
    from triton.tools.disasm import get_sass

    heads = tuple(int(x) for x in args.heads.split(","))
    for kv_dtype in args.kv_dtype:
        attention_step(kv_dtype, torch.bfloat16, not args.prefill, heads, contexts=(120, 120), prefill=40)
        kernel = next(k for name, k in reversed(built) if name == "_paged_attention_kernel")
        mix = loop_mix(get_sass(kernel.asm["cubin"]))
        top = ", ".join(f"{op} {n}" for op, n in list(mix["ops"].items())[:14])
        print(f"{kv_dtype:7s} {'prefill' if args.prefill else 'decode'}: {mix['instructions']} instructions a key "
              f"tile, {mix['stall_cycles']} stall cycles; {top}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
