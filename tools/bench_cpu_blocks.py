"""The host backend's GGUF block kernels (kernels/cpu_blocks.c) on SmolLM2-135M's shapes, against fp32 F.linear.

    python tools/bench_cpu_blocks.py [--m 1,2,4,8] [--threads 2] [--calls 200] [--source OLD.c ...]

For each shape (N x K, format) and M, times `cpu_blocks.matmul(x [M, K], W)` call by call, each call on the
next of 8 copies of W (random valid blocks: fp16 scales finite, every quant pattern valid), so the weights
come from L3 or memory as in a decode step, not from L1/L2; prints the median microseconds a call and its
GFLOP/s (2 M N K / time), and fp32 `F.linear` on the dequantized copies beside it.

`--source FILE.c[:FLAGS]` (repeatable) adds another build of a kernel source (e.g. `git show main:radianced/kernels/
cpu_blocks.c > /tmp/old.c`, or this one with `:-DNAME=VALUE`), compiled with cpu_blocks' flags into a temporary folder and called through
the same `cpu_blocks.matmul`; all builds are timed interleaved (call by call) so that a
shared machine's noise falls on each alike. The columns are named by each source's file name.

"blocks" is the build of the `radianced` this imports: run from a worktree with PYTHONPATH set to it (a
script's own folder, tools/, comes first on sys.path, so the editable install's tree is found otherwise).
The first column follows F.linear's call in each round and reads slower for it: one source built twice,
1536 x 576 q4_1 at M = 1, measured 51.4 against 45.6 us in the first and second columns, 44.1 and 43.9 with
--no-fp32; compare builds with --no-fp32.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "20000")  # as the daemon sets it (daemon.py)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from radianced.kernels import cpu_blocks  # noqa: E402
from radianced.kernels.formats import FORMATS  # noqa: E402

# SmolLM2-135M: gate/up, down, q/o, k/v (q4_1), the tied lm_head (q8_0)
SHAPES = [(1536, 576, "q4_1"), (576, 1536, "q4_1"), (576, 576, "q4_1"), (192, 576, "q4_1"), (49152, 576, "q8_0")]
F16_AT = {"q4_0": (0,), "q4_1": (0, 2), "q8_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
COPIES = 8


def random_blocks(fmt: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """[N, row bytes] uint8 of valid random blocks: random quants, fp16 scales (and mins) in +-0.1."""
    f = FORMATS[fmt]
    blocks = rng.integers(0, 256, size=(n, k // f.block, f.block_bytes), dtype=np.uint8)
    for at in F16_AT[fmt]:
        blocks[..., at:at + 2] = rng.uniform(-0.1, 0.1, size=(n, k // f.block, 1)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(blocks.reshape(n, -1))


def load_source(spec: str, folder: Path) -> ctypes.CDLL:
    """Compile `FILE.c[:EXTRA FLAGS]` in cpu_blocks.c's place beside the decode attention's source, with the
    library's flags (and the extra ones, e.g. -DNAME=1) and its headers' folder, and load it with the same
    signatures."""
    source, _, extra = spec.partition(":")
    out = folder / f"{Path(source).stem}-{len(list(folder.iterdir()))}.so"
    # the library's other sources but the fused layer's, which calls functions an older cpu_blocks.c lacks
    others = [str(s) for s in cpu_blocks.SOURCES if s.name not in ("cpu_blocks.c", "cpu_layer.c")]
    includes = f"-I{cpu_blocks.SOURCES[0].parent}"  # the sources' headers (cpu_exp.h) for a copy elsewhere
    done = subprocess.run(["cc", *cpu_blocks.FLAGS, includes, *extra.split(), "-o", str(out), source, *others],
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"cc failed on {source}: {done.stderr}")
    return cpu_blocks.declare(ctypes.CDLL(str(out)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", default="1,2,4,8", help="rows of x, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200, help="calls a build a (shape, M), in rounds of --copies")
    ap.add_argument("--source", action="append", default=[],
                    help="FILE.c[:FLAGS]: another build to time beside (repeatable; named FILE, or FILE:FLAGS)")
    ap.add_argument("--shapes", default="", help="indices into the shape list (default: all), or NxK:fmt, comma-separated")
    ap.add_argument("--copies", type=int, default=COPIES, help="copies of each W, called in turn")
    ap.add_argument("--no-fp32", action="store_true", help="leave F.linear out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ms = [int(v) for v in args.m.split(",")]
    shapes = [SHAPES[int(v)] if v.isdigit() else (*map(int, v.split(":")[0].split("x")), v.split(":")[1])
              for v in args.shapes.split(",")] if args.shapes else SHAPES

    current = cpu_blocks._lib()
    builds = {"blocks": current}
    tmp = tempfile.TemporaryDirectory()
    for src in args.source:
        stem, _, extra = src.partition(":")
        builds[Path(stem).stem + (":" + extra if extra else "")] = load_source(src, Path(tmp.name))
    real_lib = cpu_blocks._lib

    def run_build(lib):
        cpu_blocks._lib = lambda: lib  # matmul looks _lib up at each call

    rng = np.random.default_rng(0)
    names = list(builds) + ([] if args.no_fp32 else ["fp32"])
    print(f"{args.threads} thread(s), median of {args.calls} calls, each on the next of {args.copies} copies of W; "
          f"us per call (GFLOP/s)")
    print(f"{'shape':>12s} {'fmt':5s} {'M':>2s}  " + "  ".join(f"{n:>18s}" for n in names))
    try:
        for n, k, fmt in shapes:
            datas = [random_blocks(fmt, n, k, rng) for _ in range(args.copies)]
            dense = [] if args.no_fp32 else [cpu_blocks.dequantize(d, fmt, (n, k)) for d in datas]
            for m in ms:
                x = torch.randn(m, k)
                fns = {}
                for name, lib in builds.items():
                    fns[name] = (lambda i, lib=lib: (run_build(lib), cpu_blocks.matmul(x, datas[i], fmt, (n, k))))
                if dense:
                    fns["fp32"] = lambda i: F.linear(x, dense[i])
                times = {name: [] for name in fns}
                for name, fn in fns.items():  # warm-up
                    for i in range(args.copies):
                        fn(i)
                # every build agrees with fp32 up to the order of its sums (the current build's dequantization)
                run_build(current)
                ref = F.linear(x, dense[0] if dense else cpu_blocks.dequantize(datas[0], fmt, (n, k)))
                for name in builds:
                    y = fns[name](0)[1]
                    err = (y - ref).abs().max().item() / max(1.0, ref.abs().max().item())
                    if err > 1e-5:
                        sys.exit(f"{name} differs from fp32 at {n} x {k} {fmt} M = {m}: {err:.2e} of max")
                for _ in range(max(1, args.calls // args.copies)):
                    for i in range(args.copies):
                        for name, fn in fns.items():  # call by call, so that noise falls on each alike
                            t = time.perf_counter()
                            fn(i)
                            times[name].append(time.perf_counter() - t)
                cells = []
                for name in names:
                    t = statistics.median(times[name])
                    cells.append(f"{1e6 * t:9.1f} ({2 * m * n * k / t / 1e9:5.1f})")
                print(f"{n:>5d} x {k:<4d} {fmt:5s} {m:2d}  " + "  ".join(f"{c:>18s}" for c in cells), flush=True)
    finally:
        cpu_blocks._lib = real_lib


if __name__ == "__main__":
    main()
