"""Host time of the expert slab's per-step calls, `end_launch` and `count`, in us per decode step.

    python tools/bench_slab_host.py [--against REV] [--eager] [--steps 200] [--repeats 7]

Builds an `ExpertSlab` on the CPU the way the tier tests do (every expert homed in the host
pool, a quarter of them in slots), R routed layers of 128 experts, top-8, and steps it as the
pipelined decode loop does: step N+1 is launched (`begin_step`, its routing, `end_launch`)
before step N is counted (`count`), then `rebalance` (not timed). The routing is a Zipf-skewed
top-8 per row, 64 steps' worth drawn once and cycled. By default it reaches the slab as a
replayed decode graph hands it over (`record` once at a dry capture, then each step the
recorded tensors are rewritten in place and given back with `replay`); `--eager` calls
`prepare` per layer instead, as an eager forward does. Shapes: batch 1 and 32 x R = 8 and 48.

Each number is the minimum over `--repeats` of the mean per step (this VM is noisy). With
`--against REV` the same loop also runs over radianced/tiers/slab.py as of git revision REV,
interleaved with the working tree's in one process (A/B), and every step's counts and the
final stats, routing and scores of the two must be equal (aa27775 is the slab before its host
work was cut). On the CPU, `end_launch`'s copy is a plain host copy: what it saves on CUDA (no
stack launch for a replayed step, no pinned allocation and event per step) shows only on the
device (tools/time_step.py).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402

from radianced.arena import Arena  # noqa: E402
from radianced.tiers import slab as slab_module  # noqa: E402
from radianced.tiers.placement import place  # noqa: E402

E, K, WIDTH, ROUTINGS = 128, 8, 1024, 64
SHAPES = ((1, 8), (1, 48), (32, 8), (32, 48))  # (batch, routed layers)
STATS = ("lookups", "hits", "routed", "refills", "evictions", "disk_reads", "disk_bytes", "total_lookups",
         "total_hits")


def reference(rev: str) -> types.ModuleType:
    """radianced/tiers/slab.py as of git revision `rev`, imported as a module of its own."""
    src = subprocess.run(["git", "show", f"{rev}:radianced/tiers/slab.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    module = types.ModuleType(f"slab_at_{rev}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(src, f"{rev}:radianced/tiers/slab.py", "exec"), module.__dict__)
    return module


def build(module: types.ModuleType, layers: int):
    """A slab of `layers` x E host-homed experts with slots for a quarter of them (pre-filled in
    file order)."""
    keys = [(layer, e) for layer in range(layers) for e in range(E)]
    slots = len(keys) // 4
    placement = place(keys, pinned=0, host=len(keys), disk=0, slots=slots)
    host = torch.zeros(len(keys), WIDTH)
    return module.ExpertSlab(Arena(slots, WIDTH * 4), WIDTH, torch.float32, placement, host, None, E)


def routings(batch: int, layers: int, seed: int = 0) -> torch.Tensor:
    """[ROUTINGS, layers, batch, K] int64: per step, layer and row, K distinct experts drawn from a
    Zipf(1) popularity over a per-layer permutation (Gumbel top-k)."""
    rng = np.random.default_rng(seed)
    logp = np.log(1.0 / np.arange(1, E + 1))[np.argsort(rng.random((layers, E)), axis=1)]
    keys = logp[None, :, None, :] - np.log(-np.log(rng.random((ROUTINGS, layers, batch, E))))
    return torch.from_numpy(np.argsort(-keys, axis=-1)[..., :K].copy())


class Driver:
    """One slab stepped by the pipelined loop; times its end_launch and count calls."""

    def __init__(self, module: types.ModuleType, batch: int, layers: int, eager: bool):
        self.slab, self.batch, self.layers, self.eager = build(module, layers), batch, layers, eager
        self.ids = routings(batch, layers)
        self.segments = [(i, i + 1) for i in range(batch)]
        self.static = [torch.zeros(batch, K, dtype=torch.int64) for _ in range(layers)]
        self.recorded = None
        if not eager:  # a dry capture: the routing record the replays hand back
            self.slab.begin_step([], 0)
            for layer, ids in enumerate(self.static):
                self.slab.prepare(layer, ids)
            self.recorded = self.slab.record()
            self.slab.end_step()
        self.step, self.pending, self.counts = 0, None, []

    def _route(self) -> None:
        """This step's routing, as its forward leaves it."""
        ids = self.ids[self.step % ROUTINGS]
        if self.eager:
            for layer in range(self.layers):
                self.slab.prepare(layer, ids[layer])
            return
        if isinstance(self.recorded, list):  # a revision whose record is the per-layer ids tensors
            for (_, static, _), new in zip(self.recorded, ids):
                static.copy_(new)
        else:
            self.recorded.ids.copy_(ids.transpose(0, 1))  # what the graph's replay writes: [T, R, k]
        self.slab.replay(self.recorded)

    def run(self, steps: int) -> tuple[float, float]:
        """`steps` pipelined steps; returns (end_launch, count) mean seconds per step."""
        launch = count = 0.0
        for _ in range(steps):
            self.slab.begin_step(self.segments, self.batch)
            self._route()
            t0 = time.perf_counter()
            record = self.slab.end_launch()
            t1 = time.perf_counter()
            if self.pending is not None:
                self.counts.append(self.slab.count(self.pending))
            t2 = time.perf_counter()
            self.slab.rebalance()
            self.pending = record
            self.step += 1
            launch, count = launch + t1 - t0, count + t2 - t1
        return launch / steps, count / steps

    def state(self) -> tuple:
        """Everything the steps left that a reader can see."""
        s = self.slab
        stats = {name: getattr(s.stats, name) for name in STATS}
        return (self.counts, stats, s.routing, s.policy._raw.tolist(), s.policy._missed.tolist(), s.slotted())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", metavar="REV", help="also time slab.py at this git revision (A/B)")
    ap.add_argument("--eager", action="store_true", help="prepare per layer (an eager forward), not replay")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    modules = {"now": slab_module}
    if args.against:
        modules = {args.against: reference(args.against), **modules}
    print(f"us per step, min over {args.repeats} repeats of {args.steps} steps "
          f"({'eager prepare' if args.eager else 'graph replay'}; pipelined: launch N+1, count N)")
    print(f"{'batch':>5} {'R':>3}  " + "  ".join(f"{name:>10} launch {'count':>6} {'sum':>6}" for name in modules))
    for batch, layers in SHAPES:
        drivers = {name: Driver(m, batch, layers, args.eager) for name, m in modules.items()}
        for d in drivers.values():
            d.run(20)  # warm-up
        best = {name: [float("inf")] * 2 for name in drivers}
        for _ in range(args.repeats):
            for name, d in drivers.items():  # interleaved
                best[name] = [min(b, t) for b, t in zip(best[name], d.run(args.steps))]
        cells = [f"{'':>10} {1e6 * a:6.1f} {1e6 * c:6.1f} {1e6 * (a + c):6.1f}" for a, c in best.values()]
        print(f"{batch:>5} {layers:>3}  " + "  ".join(cells))
        if args.against:
            ref, now = (d.state() for d in drivers.values())
            if ref != now:
                print(f"  MISMATCH at batch {batch}, R {layers}: the two slabs parted", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
