"""A/B of decode-step variants on one engine: the same model, requests and context, interleaved rounds.

    python tools/ab_decode.py --out OUT --variant wait:RADIANCED_PDL=1 --variant early:RADIANCED_PDL=3
        [--layers 8] [--batch 1] [--steps 40] [--rounds 4]

A variant is NAME:ENV=VALUE[,ENV=VALUE...]: environment settings the kernels'
launchers read when a decode graph is captured (RADIANCED_PDL, read through
kernels/pdl.py's cache, which is cleared before each capture). Builds a
synthetic Qwen3-30B-A3B-shaped model (tools/make_synthetic.py), serves
`--batch` requests of a 1K-token prompt with every expert resident, captures
one set of decode graphs per variant, then times `--rounds` rounds, each
variant in turn within a round (drift and clocks fall on every variant alike):
the daemon's loop (`AsyncEngine.run` through `bench_model.daemon_loop`, wall time
per step over `--steps` steps), `StepGraphs.run` (the inputs' host work and the replay, CUDA events,
median of `--steps`) and the captured graph replayed `--steps` times back to
back (the device's work alone). Writes
OUT/ab_decode.json and prints the medians over rounds. Differences of a few
microseconds between whole runs of bench_model drown in the first-run effect;
within one process, interleaved, they do not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radianced.config import Config  # noqa: E402
from radianced.engine import engine as engine_module  # noqa: E402
from radianced.engine.engine import Engine  # noqa: E402
from radianced.engine.request import Request  # noqa: E402
from radianced.engine.sampling_params import SamplingParams  # noqa: E402
from radianced.kernels import pdl  # noqa: E402
from radianced.model.rad import RadFile  # noqa: E402
from tools.bench_model import daemon_loop  # noqa: E402
from tools.gpu_bench import timeit  # noqa: E402
from tools.make_synthetic import make_synthetic  # noqa: E402

PROMPT = 1024


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """'name:A=1,B=2' -> ('name', {'A': '1', 'B': '2'}); 'name' alone: no settings."""
    name, _, rest = text.partition(":")
    env = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SystemExit(f"--variant {text!r}: settings are ENV=VALUE, comma-separated")
        env[key] = value
    if not name:
        raise SystemExit(f"--variant {text!r}: give it a name before the ':'")
    return name, env


def capture(engine: Engine, cfg: Config, env: dict[str, str]):
    """The decode graphs captured under `env` (set for the capture, then restored)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    pdl._level.cache_clear()
    try:
        return engine_module._step_graphs(engine, cfg, engine.receipt, True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        pdl._level.cache_clear()


def replay(engine: Engine, steps: int) -> tuple[float, float]:
    """For the requests' next step: median seconds of `StepGraphs.run` (the inputs' host work
    and copies, then the replay), and seconds per replay of the captured graph alone, `steps`
    replays back to back between two CUDA events (the device's work without the host's)."""
    plan = engine.scheduler.schedule()
    seqs = plan.seqs
    args = ([q.token_ids[0] for q in seqs], [q.context_before for q in seqs], [q.block_table[0] for q in seqs],
            [q.state_slot for q in seqs])
    graphs = engine.runner.graphs
    t_run = timeit(lambda: graphs.run(*args), "cuda", warmup=3, reps=steps)["median_s"]
    graph = graphs.graph(graphs.bucket(len(seqs)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    end.synchronize()
    t_device = start.elapsed_time(end) / 1e3 / steps
    engine.scheduler.update(plan, engine.runner.run(plan))
    return t_run, t_device


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--variant", action="append", required=True, help="NAME:ENV=VALUE[,ENV=VALUE...]")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("ab_decode needs CUDA (decode graphs)")
    variants = dict(parse_variant(v) for v in args.variant)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    total_steps = args.rounds * len(variants) * (2 * args.steps + 8) + 64
    times: dict[str, dict[str, list[float]]] = {n: {"pipelined_s": [], "run_s": [], "device_s": []}
                                                for n in variants}
    with tempfile.TemporaryDirectory(dir="/var/tmp" if Path("/var/tmp").is_dir() else None) as tmp:
        rad = RadFile.open(make_synthetic(Path(tmp) / "m.rad", layers=args.layers, device="cuda", progress=False))
        cfg = Config(placement="resident", max_model_len=PROMPT + total_steps, max_num_seqs=args.batch,
                     max_num_batched_tokens=PROMPT * args.batch)
        engine = Engine.build(rad, msgspec.structs.replace(cfg, enforce_eager=True), None, "cuda")
        graphs = {name: capture(engine, cfg, env) for name, env in variants.items()}
        params = SamplingParams(temperature=0.0, max_tokens=total_steps, ignore_eos=True)
        g = torch.Generator().manual_seed(0)
        prompts = [tuple(torch.randint(0, rad.model.vocab_size - 3, (PROMPT,), generator=g).tolist())
                   for _ in range(args.batch)]
        for r in range(args.rounds):
            for name in variants:
                engine.runner.graphs = graphs[name]
                # the same prompts every round: after the first, their prefill is a prefix-cache hit
                seqs = [engine.add(Request(f"r{r}-{name}-{i}", p, params, frozenset())) for i, p in enumerate(prompts)]
                while any(q.num_output_tokens == 0 for q in seqs):  # prefill
                    engine.step()
                t_run, t_device = replay(engine, args.steps)
                times[name]["run_s"].append(t_run)
                times[name]["device_s"].append(t_device)
                times[name]["pipelined_s"].append(daemon_loop(engine, 2, args.steps)["mean_s"])  # ends them
        engine.scheduler.abort_all()
        engine.settle()
        rad.close()
    result = {"device": torch.cuda.get_device_name(), "layers": args.layers, "batch": args.batch,
              "steps": args.steps, "rounds": args.rounds, "variants": variants,
              "times": times, "median_ms": {n: {k: 1e3 * statistics.median(v) for k, v in t.items()}
                                            for n, t in times.items()}}
    (out / "ab_decode.json").write_text(json.dumps(result, indent=2))
    print(f"decode A/B, {args.layers} layers, batch {args.batch}, {args.rounds} rounds x {args.steps} steps "
          f"({result['device']}), median ms over rounds:")
    for name, m in result["median_ms"].items():
        print(f"  {name:>16}: pipelined {m['pipelined_s']:.3f}  graphs.run {m['run_s']:.3f}  "
              f"replays back to back {m['device_s']:.3f}   {variants[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
