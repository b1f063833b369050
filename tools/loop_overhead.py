"""What the daemon's loop costs the host a step, without a model or a GPU: a real scheduler over a stand-in device.

    python tools/loop_overhead.py [--device-ms 0.6] [--batches 1,32] [--steps 2000] [--out DIR]

The engine here has the real scheduler and block allocator and a stand-in
runner: `launch` queues the step on a "device" that takes `--device-ms` a step
(back to back, as a GPU stream), `collect` waits (spinning, as a CUDA event
synchronize does) until that step is done and samples token 7 for every row.
Three loops step it, the same requests each time:

- `Engine.step(ahead=True)`: the engine's rounds, synchronously, on one thread;
- `AsyncEngine.run`: the daemon's loop (uvloop; the rounds on its step thread);
- the same, with the engine's phases timed: plan, execute, apply, and the rest: the
  driver's own work (counting, the events handed to the event loop).

The daemon's loop minus the synchronous rounds is what the driver costs a step. When
the event loop planned and applied each round (until b40e1cf) that was a thread round
trip a step: on the H200 at b1 (0.6 ms of device work a step) the daemon's step took
1.31 ms where `Engine.step` took 0.84 (bench/README, session 8). Prints a table; with
--out writes loop_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radianced.engine.engine import Engine  # noqa: E402
from radianced.engine.plan import StepOutput  # noqa: E402
from radianced.engine.request import Request  # noqa: E402
from radianced.engine.sampling_params import SamplingParams  # noqa: E402
from radianced.engine.scheduler import Scheduler  # noqa: E402
from radianced.kv.blocks import BlockAllocator  # noqa: E402
from radianced.kv.prefix import PrefixCache  # noqa: E402
from tools.bench_model import daemon_loop  # noqa: E402


class StandInRunner:
    """A device that takes `seconds` a step, steps queued back to back."""

    def __init__(self, seconds: float):
        self.seconds, self.busy_until = seconds, 0.0

    def launch(self, plan):
        self.busy_until = max(time.perf_counter(), self.busy_until) + self.seconds
        return SimpleNamespace(plan=plan, done=self.busy_until)

    def collect(self, step) -> StepOutput:
        while time.perf_counter() < step.done:
            pass
        return StepOutput(tuple(((7,) if s.sample else ()) for s in step.plan.seqs))


def stand_in_engine(batch: int, device_s: float) -> Engine:
    """An engine of `batch` running requests (prefilled) over the stand-in device."""
    allocator = BlockAllocator.fixed(8192, 16)
    scheduler = Scheduler(allocator=allocator, max_num_seqs=batch, max_num_batched_tokens=8192, max_queue=64,
                          prefix=PrefixCache(allocator, False, None), hybrid=False, max_model_len=1 << 20)
    engine = Engine(scheduler, StandInRunner(device_s), tokenizer=SimpleNamespace(eos_token_ids=()))
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    for i in range(batch):
        engine.add(Request(f"r{i}", tuple(range(100)), params, frozenset()))
    engine.step()
    return engine


def timed_phases(engine: Engine) -> tuple[dict[str, float], dict[str, int]]:
    """Wrap the engine's phases so each call adds its seconds (execute: inside the worker), and
    counts itself."""
    acc = {"plan": 0.0, "execute": 0.0, "apply": 0.0}
    calls = dict.fromkeys(acc, 0)
    for name in acc:
        phase = getattr(engine, name)

        def timed(*args, _phase=phase, _name=name):
            t0 = time.perf_counter()
            try:
                return _phase(*args)
            finally:
                acc[_name] += time.perf_counter() - t0
                calls[_name] += 1

        setattr(engine, name, timed)
    return acc, calls


def measure(batch: int, device_s: float, steps: int) -> dict:
    engine = stand_in_engine(batch, device_s)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step(ahead=True)
    rounds = (time.perf_counter() - t0) / steps
    engine.step()
    loop = daemon_loop(stand_in_engine(batch, device_s), 10, steps)["mean_s"]
    engine = stand_in_engine(batch, device_s)
    acc, calls = timed_phases(engine)
    timed = daemon_loop(engine, 1, steps)["mean_s"]
    phases = {k: v / calls[k] for k, v in acc.items()}  # a round a step, in steady state
    phases["the driver's own"] = timed - sum(phases.values())
    return {"batch": batch, "device_s": device_s, "engine_rounds_s": rounds, "daemon_loop_s": loop,
            "daemon_loop_timed_s": timed, "phases_s": phases}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device-ms", type=float, default=0.6)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        runs = [measure(b, args.device_ms / 1e3, args.steps) for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["daemon_loop_s"])
        best["daemon_loop_s_all"] = [r["daemon_loop_s"] for r in runs]
        best["engine_rounds_s_all"] = [r["engine_rounds_s"] for r in runs]
        rows.append(best)
        us = {k: 1e6 * v for k, v in best["phases_s"].items()}
        print(f"b{b}, stand-in device {args.device_ms:.2f} ms a step, us a step (median of {args.repeats}): "
              f"engine rounds {1e6 * statistics.median(best['engine_rounds_s_all']):.0f}, "
              f"daemon loop {1e6 * statistics.median(best['daemon_loop_s_all']):.0f}; "
              + ", ".join(f"{k} {v:.0f}" for k, v in us.items()))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "loop_overhead.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
