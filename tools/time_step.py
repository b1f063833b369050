"""Where a decode step's time goes, by phase, on the device (host wall time per call), and by kernel.

    python tools/time_step.py --out OUT [--shape S] [--quantize CLASS=SCHEME] [--layers 2] [--batch 1]
                              [--steps 40] [--kernels] [--sequential]
                              [--prefill-chunk N]

Builds a synthetic Qwen3-30B-A3B-shaped model (tools/make_synthetic.py; `--shape`, `--quantize`
pick another shape and compact experts or layers) with `--layers` layers, serves `--batch` requests of a
1K-token prompt through `Engine.build` (resident placement; decode CUDA graphs on CUDA), and after a
warm-up steps it as the daemon's loop does (`Engine.step(ahead=True)`: step N+1
launched before step N is collected; `--sequential`: `Engine.step()`), timing each phase
by wrapping the engine's own methods (schedule / schedule_ahead / update, the
runner's launch and collect, graph or eager forward, the slab's calls, sampling
tensors, sampler, settle). No synchronisation is added: a phase that waits for
the device (collect) absorbs the device time queued before it. Writes
OUT/time_step.json and prints a table, ms per step, with the whole step.

On CUDA it also measures the step graphs' memory against the "graph pool" line
of the receipt planned with graphs (the engine is built eager, then the graphs
are captured here between two readings of the allocator), and with `--kernels`
the device time of each kernel per step from the CUDA profiler (graph replays
included), biggest first.

With `--prefill-chunk N` the timed steps are mixed steps, as a prefill beside running streams makes them
(issue 18's ITL under a burst): after the warm-up a long prompt joins, and each step takes the batch's
decodes and the prompt's next N tokens (the scheduler's step budget set to batch + N, as the daemon's
pacer sets it). Such a step replays a mixed graph where batch + N fits one (at most 2,048 tokens,
radianced/graph_shapes.py), else runs eagerly: comparing the phases' host time with the kernels' device time says
how much of its cost is the host launching it.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radianced.budget import plan  # noqa: E402
from radianced.card import Card  # noqa: E402
from radianced.config import Config  # noqa: E402
from radianced.engine import engine as engine_module  # noqa: E402
from radianced.engine import runner as runner_module  # noqa: E402
from radianced.engine.engine import Engine  # noqa: E402
from radianced.engine.request import Request  # noqa: E402
from radianced.engine.sampling_params import SamplingParams  # noqa: E402
from radianced.model.rad import RadFile  # noqa: E402
from radianced.sizing import ModelFacts  # noqa: E402
from tools.make_synthetic import make_synthetic  # noqa: E402

PROMPT = 1024


def timed(totals: dict, name: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            totals[name] += time.perf_counter() - t0
    return wrapper


def instrument(engine: Engine, totals: dict) -> None:
    """Wrap the phases of a step (instance attributes shadow the methods; nothing else changes)."""
    sched, runner = engine.scheduler, engine.runner
    sched.schedule = timed(totals, "scheduler.schedule", sched.schedule)
    sched.schedule_ahead = timed(totals, "scheduler.schedule_ahead", sched.schedule_ahead)
    sched.update = timed(totals, "scheduler.update", sched.update)
    runner.launch = timed(totals, "runner.launch (all of it)", runner.launch)
    runner.collect = timed(totals, "runner.collect (all of it: waits for the step)", runner.collect)
    if runner.graphs is not None:
        runner.graphs.run = timed(totals, "  graphs.run (inputs + replay)", runner.graphs.run)
    runner.model.forward = timed(totals, "  model.forward (eager)", runner.model.forward)
    if engine.experts is not None:
        slab = engine.experts
        slab.begin_step = timed(totals, "  slab.begin_step", slab.begin_step)
        slab.end_launch = timed(totals, "  slab.end_launch", slab.end_launch)
        slab.count = timed(totals, "  slab.count", slab.count)
    runner.sampler.sample = timed(totals, "  sampler.sample", runner.sampler.sample)
    runner._output = timed(totals, "  runner._output", runner._output)
    tensors = runner_module.SamplingTensors
    tensors.build = staticmethod(timed(totals, "  SamplingTensors.build", tensors.build))
    engine.settle = timed(totals, "engine.settle", engine.settle)


def capture_graphs(engine: Engine, rad: RadFile, cfg: Config) -> dict | None:
    """Capture the step graphs into the eager-built engine, as Engine.build does; returns what
    they hold (allocated after, peak reserved during, both over the readings before) beside the
    receipt's "graph pool" line, or None where the engine decodes eagerly."""
    dev = torch.device("cuda")
    torch.cuda.synchronize()
    before, reserved = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    graphs = engine_module._step_graphs(engine, cfg, engine.receipt, True)
    if graphs is None:
        return None
    engine.runner.graphs = graphs
    total = torch.cuda.mem_get_info(dev)[1]
    receipt = plan(Card(total, total, cuda=True), ModelFacts.from_header(rad.header), cfg)  # as with graphs
    pool = next(p.bytes for p in receipt.workspace if p.name == "graph pool")
    return {"held": torch.cuda.memory_allocated(dev) - before,
            "peak_reserved": torch.cuda.max_memory_reserved(dev) - reserved, "receipt_graph_pool": pool}


def kernel_table(step, steps: int) -> dict:
    """Device time of each kernel (and copy) per step over `steps` calls of `step`, by name."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    us: dict = defaultdict(float)
    calls: dict = defaultdict(int)
    for ev in prof.events():
        if ev.device_type == DeviceType.CUDA:
            us[ev.name] += ev.time_range.elapsed_us()
            calls[ev.name] += 1
    rows = [{"name": n, "us": t / steps, "calls": calls[n] / steps} for n, t in us.items()]
    rows.sort(key=lambda r: -r["us"])
    return {"total": sum(r["us"] for r in rows), "launches": sum(r["calls"] for r in rows), "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen3-30b-a3b", help="a tools/make_synthetic.py shape")
    ap.add_argument("--quantize", default=None, help="make_synthetic's --quantize, e.g. experts=int4")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--narrow", type=int, default=1, help="width divisor (CPU checks)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kernels", action="store_true", help="per-kernel device time per step (CUDA profiler)")
    ap.add_argument("--sequential", action="store_true", help="Engine.step() instead of Engine.step(ahead=True)")
    ap.add_argument("--prefill-chunk", type=int, default=0, help="time mixed steps: decodes + N prefill tokens")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir="/var/tmp" if Path("/var/tmp").is_dir() else None) as tmp:
        path = make_synthetic(Path(tmp) / "m.rad", shape=args.shape, layers=args.layers, narrow=args.narrow,
                              device=device, vocab=None if args.narrow == 1 else 4096, progress=False,
                              quantize=args.quantize)
        rad = RadFile.open(path)
        chunk = args.prefill_chunk
        long_prompt = chunk * (2 * args.steps + 4)  # a chunk for each timed and each profiled step, and spare
        cfg = Config(placement="resident", max_model_len=max(PROMPT + 3 * args.steps + 64, long_prompt + 64),
                     max_num_seqs=max(args.batch, 1) + (chunk > 0),
                     max_num_batched_tokens=max(PROMPT * args.batch, args.batch + chunk))
        card = Card.from_mib(2048) if device == "cpu" else None
        engine = Engine.build(rad, msgspec.structs.replace(cfg, enforce_eager=True), card, device)
        graph_memory = capture_graphs(engine, rad, cfg) if device == "cuda" else None
        g = torch.Generator().manual_seed(0)
        params = SamplingParams(temperature=0.0, max_tokens=3 * args.steps, ignore_eos=True)
        for i in range(args.batch):
            prompt = tuple(torch.randint(0, rad.model.vocab_size - 3, (PROMPT,), generator=g).tolist())
            engine.add(Request(f"r{i}", prompt, params, frozenset()))
        step = functools.partial(engine.step, ahead=not args.sequential)
        for _ in range(args.steps // 2 + 1):  # prefill and warm-up decode
            step()
        if chunk:  # every step from here: the decodes and the long prompt's next chunk
            prompt = tuple(torch.randint(0, rad.model.vocab_size - 3, (long_prompt,), generator=g).tolist())
            engine.add(Request("long", prompt, SamplingParams(temperature=0.0, max_tokens=1), frozenset()))
            engine.scheduler.step_tokens = args.batch + chunk
            step()
        totals: dict = defaultdict(float)
        instrument(engine, totals)
        t0 = time.perf_counter()  # between returns of step(): each return follows one finished step
        for _ in range(args.steps):
            step()
        whole = time.perf_counter() - t0
        per_step = {k: 1e3 * v / args.steps for k, v in totals.items()}  # before the profiled steps add to it
        kernels = kernel_table(step, args.steps) if args.kernels and device == "cuda" else None
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "shape": args.shape,
              "quantize": args.quantize, "layers": args.layers,
              "batch": args.batch, "prefill_chunk": chunk, "steps": args.steps,
              "graphs": engine.runner.graphs is not None,
              "loop": "Engine.step (sequential)" if args.sequential else "Engine.step(ahead=True)",
              "step_ms": 1e3 * whole / args.steps, "phases_ms": per_step, "graph_memory": graph_memory,
              "kernels_us_per_step": kernels}
    (out / "time_step.json").write_text(json.dumps(result, indent=2))
    kind = f"mixed step ({chunk} prefill tokens)" if chunk else "decode step"
    print(f"{kind}, {args.shape} {args.quantize or ''} {args.layers} layers, batch {args.batch}, "
          f"graphs {result['graphs']}, {result['loop']}: "
          f"{result['step_ms']:.3f} ms per step")
    for k, v in sorted(per_step.items(), key=lambda kv: -kv[1]):
        print(f"  {v:8.3f} ms  {k}")
    if graph_memory:
        print("step graphs: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in graph_memory.items()))
    if kernels:
        print(f"kernels: {kernels['total']:.1f} us of device time per step in {kernels['launches']:.0f} launches")
        for row in kernels["rows"][:40]:
            print(f"  {row['us']:8.1f} us  {row['calls']:5.1f}x  {row['name'][:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
