"""Where a host-backend decode step's time goes: the engine in-process, each part of the step timed.

    python tools/cpu_step.py MODEL.rad [--batch 1] [--threads 1] [--steps 30] [--context 40]
                                       [--kv-cache-dtype auto] [--profile]

Builds the engine as `Engine.build` does on the CPU (with `--kv-cache-dtype`), starts `--batch` greedy requests
on distinct `--context`-token prompts, runs their prefill and two decode steps, then times `--steps` decode steps
(`Engine.step`): the median step, and per step the time inside each wrapped part (the ops the model
calls through `kernels.ops`, the lm_head, the sampler, the scheduler; nested parts count in their
parents: "linear" includes the lm_head's projection). `--profile` also prints torch.profiler's
per-op self times over the same steps (the profiler's own cost inflates the step).

Compare two trees by running this file with PYTHONPATH set to each, interleaved, on a quiet machine;
set GOMP_SPINCOUNT=20000 as the daemon does (daemon.py) when using more than one thread.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections import defaultdict

import torch

from radianced.bench.workloads import prompt_ids
from radianced.card import Card
from radianced.config import Config
from radianced.engine.engine import Engine
from radianced.engine.request import Request
from radianced.engine.sampling_params import SamplingParams
from radianced.kernels import ops
from radianced.model import layers
from radianced.model.rad import RadFile


def wrap(totals: dict, obj, name: str, label: str) -> None:
    """Replace `obj.name` by a wrapper adding its wall time to totals[label]."""
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            totals[label] += time.perf_counter() - t

    setattr(obj, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--context", type=int, default=40, help="prompt tokens of each request")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = Config(max_num_seqs=max(8, args.batch), max_model_len=max(4096, args.context + args.steps + 64),
                 kv_cache_dtype=args.kv_cache_dtype)
    engine = Engine.build(RadFile.open(args.model), cfg, Card.from_mib(4096), "cpu")
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    for i in range(args.batch):
        engine.add(Request(f"r{i}", tuple(prompt_ids(args.context, f"p{i}")), params))
    while engine.scheduler.waiting or any(s.num_computed_tokens < args.context for s in engine.scheduler.running):
        engine.step()  # the prefill, in as many chunks as it takes
    for _ in range(2):
        engine.step()
    totals: dict[str, float] = defaultdict(float)
    for name in ("linear", "silu_mlp", "rotary_paged_attention", "rms_norm"):
        wrap(totals, ops, name, f"ops.{name}")
    wrap(totals, layers.LMHead, "__call__", "lm_head (final norm + projection)")
    wrap(totals, layers.Embedding, "__call__", "embedding")
    wrap(totals, engine.runner.model, "forward", "model.forward")
    wrap(totals, engine.runner.sampler, "sample", "sampler.sample")
    wrap(totals, engine.scheduler, "schedule", "scheduler.schedule")
    wrap(totals, engine.scheduler, "update", "scheduler.update")
    times = []
    prof = None
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        prof = profile(activities=[ProfilerActivity.CPU])
        prof.__enter__()
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    if prof is not None:
        prof.__exit__(None, None, None)
    print(f"batch {args.batch}, {args.threads} thread(s), context {args.context}, kv {args.kv_cache_dtype}: median "
          f"step {1e3 * statistics.median(times):.2f} ms (min {1e3 * min(times):.2f}) over {args.steps} steps")
    for label, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {label:36s} {1e3 * seconds / args.steps:8.2f} ms/step")
    if prof is not None:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
