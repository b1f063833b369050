"""A/B of the daemon's step loop: rounds on the event loop (b40e1cf) against rounds on the step thread.

    python tools/ab_loop.py --out OUT [--layers 8] [--batches 1,32] [--steps 128] [--rounds 7]

Until b40e1cf the driver planned and applied each round on the event loop and
executed it on its worker thread, a thread round trip a round (`_LoopRounds.run`
below is that loop, over today's engine phases); now the step thread runs the
rounds on its own (engine/driver.py). Both are timed here on one engine, one
model and one machine, in the same process: a synthetic Qwen3-30B-A3B-shaped
`.rad` (tools/make_synthetic.py) with every expert resident and decode graphs
captured; everything under the loop (scheduler, runner, graphs, slab) is the
same code for both, so the difference is the loop alone. Each round serves
`batch` requests of a 1K-token prompt (the same prompts every round: after the
first, prefill is a prefix-cache hit and the context is the same) and times
`--steps` steady-state decode steps of each loop in turn (greedy), with
`tools/bench_model.daemon_loop`. No HTTP work runs beside them: this is the
hand-off's cost alone, not the event loop's queue that the change takes the
rounds out of (tools/bench_served.py's burst rows measure that). Writes
OUT/ab_loop.json; prints new/old per batch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radianced.config import Config  # noqa: E402
from radianced.engine.driver import AsyncEngine  # noqa: E402
from radianced.engine.engine import Engine  # noqa: E402
from radianced.engine.request import Request  # noqa: E402
from radianced.engine.sampling_params import SamplingParams  # noqa: E402
from radianced.model.rad import RadFile  # noqa: E402
from tools.bench_model import daemon_loop  # noqa: E402
from tools.make_synthetic import make_synthetic  # noqa: E402

PROMPT = 1024


class _LoopRounds(AsyncEngine):
    """b40e1cf's `AsyncEngine.run`: each round planned and applied on the event loop and executed on
    the worker thread (a thread round trip a round), which rounds on the step thread replaced."""

    async def run(self) -> None:
        loop, engine = asyncio.get_running_loop(), self.engine
        self._loop = loop
        start = None
        try:
            while True:
                self._take_inbox()
                if (work := engine.plan()) is None:  # the requests were added before the run: it ends idle
                    await asyncio.sleep(0.001)
                    continue
                start = start or time.perf_counter()
                done = await loop.run_in_executor(self._worker, engine.execute, work)
                events = engine.apply(done)
                if done.finished is not None:
                    counts = self._count_step(done, time.perf_counter() - start)
                    self._dispatch(events, counts, time.perf_counter())
                    start = time.perf_counter() if done.launched is not None else None
        finally:
            self._worker.shutdown(wait=True)


LOOPS = {"loop_rounds_b40e1cf": _LoopRounds, "new": AsyncEngine}
OLD = "loop_rounds_b40e1cf"


def serve_round(engine: Engine, prompts: list[tuple[int, ...]], steps: int, loop_cls) -> float:
    """Prefill the prompts (sequential steps), then seconds per decode step of `loop_cls`'s loop."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    seqs = [engine.add(Request(f"r{time.monotonic_ns()}-{i}", p, params, frozenset())) for i, p in enumerate(prompts)]
    while any(q.num_output_tokens == 0 for q in seqs):
        engine.step()
    return daemon_loop(engine, 8, steps, driver=loop_cls)["mean_s"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("ab_loop times the loop over decode graphs: it needs CUDA")
    batches = [int(b) for b in args.batches.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    times = {b: {name: [] for name in LOOPS} for b in batches}
    with tempfile.TemporaryDirectory(dir="/var/tmp" if Path("/var/tmp").is_dir() else None) as tmp:
        rad = RadFile.open(make_synthetic(Path(tmp) / "m.rad", layers=args.layers, device="cuda", progress=False))
        cfg = Config(placement="resident", max_model_len=PROMPT + args.steps + 128, max_num_seqs=max(batches),
                     max_num_batched_tokens=PROMPT * max(batches))
        engine = Engine.build(rad, cfg, None, "cuda")
        g = torch.Generator().manual_seed(0)
        prompts = [tuple(torch.randint(0, rad.model.vocab_size - 3, (PROMPT,), generator=g).tolist())
                   for _ in range(max(batches))]
        for b in batches:
            serve_round(engine, prompts[:b], args.steps, AsyncEngine)  # warm-up: compiles, prefix cache
            for r in range(args.rounds):
                order = list(LOOPS) if r % 2 == 0 else list(reversed(LOOPS))  # neither always goes first
                for name in order:
                    times[b][name].append(serve_round(engine, prompts[:b], args.steps, LOOPS[name]))
        rad.close()
    median = {b: {n: statistics.median(v) for n, v in t.items()} for b, t in times.items()}
    result = {"device": torch.cuda.get_device_name(), "layers": args.layers, "steps": args.steps,
              "rounds": args.rounds, "times_s": times, "median_s": median,
              "new_speed_over_old": {b: m[OLD] / m["new"] for b, m in median.items()}}
    (out / "ab_loop.json").write_text(json.dumps(result, indent=2))
    print(f"daemon loop A/B, {args.layers} layers, {args.rounds} interleaved rounds x {args.steps} steps "
          f"({result['device']}), median ms a step:")
    for b, m in median.items():
        print(f"  b{b:<3} old (rounds on the loop) {1e3 * m[OLD]:.3f}  new {1e3 * m['new']:.3f}  "
              f"new speed / old {result['new_speed_over_old'][b]:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
