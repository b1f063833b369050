"""Issue 8's whole-model rows: decode and prefill through the product path, and Hugging Face
transformers on the same GPU, each against a ceiling measured in the same run.

    python tools/bench_model.py --out DIR [--layers 8] [--quick] [--time-limit 185] [--only decode|prefill|transformers]

A synthetic Qwen3-30B-A3B-shaped `.rad` (tools/make_synthetic.py: real per-layer
shapes, random bf16 weights, uniform routing, `--layers` of the 48 layers) is
served by `Engine.build(rad, Config(placement="resident", ...), card)`: every
expert in arena slots, requests through the scheduler, the runner, the sampler.

- ceilings (tools/gpu_bench.py, same code as gpu_check's): HBM device copy
  (bytes read + written / time) and bf16 matmul 8192^3;
- decode b1 / b32, 1,024-token prompts, greedy (the floor counts the model's
  bytes; the sampler's work is not in it), and b1 again sampled at temperature 1
  (vLLM's benchmark_latency samples so): steps of the daemon's own loop
  (`AsyncEngine.run`: asyncio, its worker thread, step N+1 launched before step
  N is collected; wall time per step in steady state), `Engine.step()`
  (sequential; CUDA events, the step ends
  in its host sync), then the same step's `runner.run(plan)` alone (no
  scheduler), `model.forward(batch)` alone (no batch building, no sampler) and
  the forward's summed kernel time (CUDA profiler): the gaps are host overhead.
  Floor: bytes the step must move
  (dense weights of the layers, the distinct experts the steps routed, K and V
  of the context, embedding rows, lm_head) / copy bandwidth, or FLOP / matmul
  rate if larger;
- prefill of one 4,096-token prompt in one step: FLOP (every matmul: q/k/v/o,
  router, top_k routed experts per token, causal attention QK^T and PV, the one
  lm_head row) / time, against the matmul rate;
- transformers: `AutoModelForCausalLM.from_config` of the same Qwen3-MoE config
  (same layers, random bf16 weights on the device, `attn_implementation="sdpa"`,
  its default experts implementation), a 1,024-token prompt per sequence
  prefilled, then a manual greedy decode loop with its DynamicCache; step time at
  b1 and b32, and our decode tok/s over theirs.

Writes DIR/bench_model.json (every timing, rewritten after each section) and
DIR/bench_model.md (the table; printed last). Without CUDA (or `--quick`) it
runs at width / 16, 2 layers, small contexts on the CPU: that proves the code
paths, nothing about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402
import uvloop  # noqa: E402

from radianced.engine.driver import AsyncEngine  # noqa: E402
from radianced.engine.engine_metrics import NoMetrics  # noqa: E402
from tools.gpu_bench import (  # noqa: E402
    GiB, MiB, Skip, _mib, _ms, _rate, _section, ceiling_copy, ceiling_matmul, commit, fingerprint,
    timeit)
from tools.make_synthetic import make_synthetic  # noqa: E402

SHAPE = "qwen3-30b-a3b"
PARTS = ("decode", "prefill", "transformers")  # --only
REAL_LAYERS = 48


@dataclass(frozen=True)
class Sizes:
    """What one run measures (the device's sizes, or the CPU dry run's)."""

    layers: int
    narrow: int
    vocab: int | None
    context: int  # prompt tokens per decoding sequence
    batches: tuple[int, ...]
    prefill: int  # tokens of the one prefill prompt
    reps: int
    copy_bytes: int
    matmul_n: int

    @classmethod
    def pick(cls, quick: bool, layers: int | None) -> Sizes:
        if quick:
            return cls(layers or 2, 16, 4096, 64, (1, 4), 256, 3, 64 * MiB, 256)
        return cls(layers or 8, 1, None, 1024, (1, 32), 4096, 20, 2 * GiB, 8192)


class State:
    """What the sections hand each other: the model file, the engine, the HF model, the deadline."""

    def __init__(self, device: str, sizes: Sizes, deadline: float):
        self.device, self.sizes, self.deadline = device, sizes, deadline
        self.rad = self.engine = self.hf = None
        self.gen = torch.Generator().manual_seed(0)

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise Skip("past --time-limit; skipped so the step ends in time")

    def prompt(self, n: int) -> tuple[int, ...]:
        """n random token ids below the special tokens (no prefix-cache hits between prompts)."""
        return tuple(torch.randint(0, self.rad.model.vocab_size - 3, (n,), generator=self.gen).tolist())


# -- model and engine ----------------------------------------------------------------------


def model_dir(layers: int) -> Path:
    """$RADIANCED_DISK_DIR, /var/tmp or /tmp: the first with room for the file (about 1.3 GiB a layer)."""
    need = layers * 1.3 * GiB + 2 * GiB
    for d in filter(None, (os.environ.get("RADIANCED_DISK_DIR"), "/var/tmp", "/tmp")):
        if Path(d).is_dir() and shutil.disk_usage(d).free > need:
            return Path(d)
    raise RuntimeError(f"no folder with {need / GiB:.0f} GiB free for the synthetic model; set RADIANCED_DISK_DIR")


def section_model(st: State, folder: Path) -> dict:
    from radianced.model.rad import RadFile

    s = st.sizes
    t0 = time.perf_counter()
    path = make_synthetic(folder / "model.rad", shape=SHAPE, layers=s.layers, zipf=0.0, vocab=s.vocab,
                          narrow=s.narrow, device=st.device)
    st.rad = RadFile.open(path)
    return {"path": str(path), "bytes": path.stat().st_size, "seconds": time.perf_counter() - t0,
            "source": st.rad.header.source, "layers": s.layers, "real_layers": REAL_LAYERS}


def section_engine(st: State) -> dict:
    """Engine.build with every expert resident, the embedding on the card, room for the runs' KV."""
    from radianced.card import Card, detect_card
    from radianced.config import Config
    from radianced.engine.engine import Engine

    s = st.sizes
    flags = dict(placement="resident", embedding_placement="vram", max_model_len=2 * s.prefill,
                 max_num_seqs=max(s.batches), max_num_batched_tokens=s.prefill, max_queue=2 * max(s.batches))
    if st.device == "cuda":
        torch.zeros(1, device="cuda")  # the context exists before the card is read
        card = detect_card("cuda")
        in_use = -(-(card.total_bytes - card.free_bytes) // MiB)
        flags["gpu_memory_mib"] = in_use + -(-st.rad.path.stat().st_size // MiB) + 8192
    else:
        card = Card.from_mib(2048)
    t0 = time.perf_counter()
    st.engine = Engine.build(st.rad, Config(**flags), card, device=st.device, sampler_seed=0)
    r = st.engine.receipt
    graphs = st.engine.runner.graphs
    return {"flags": flags, "seconds": time.perf_counter() - t0, "receipt": r.lines(),
            "expert_slots": st.engine.experts.num_slots, "experts": len(st.rad.header.experts),
            "decode_graph_buckets": list(graphs.buckets) if graphs is not None else None}


# -- our rows ---------------------------------------------------------------------------------


def _request(st: State, rid: str, n: int, seed: int, sampled: bool = False):
    """A request of an n-token random prompt decoding without end: greedy, or sampled at
    temperature 1 with a seed (vLLM's benchmark_latency samples so)."""
    from radianced.engine.request import Request
    from radianced.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=1.0 if sampled else 0.0, seed=seed if sampled else None, ignore_eos=True,
                            max_tokens=1 << 20)
    return Request(rid, st.prompt(n), params)


def _forward_batch(runner, plan):
    """The ForwardBatch the runner builds for `plan` (the same call, for timing the forward alone)."""
    from radianced.model.batch import ForwardBatch

    seqs = plan.seqs
    return ForwardBatch.build(
        [list(s.token_ids) for s in seqs], [s.context_before for s in seqs], [list(s.block_table[0]) for s in seqs],
        runner.cache.block_size, logits=[s.sample for s in seqs],
        state_slots=[s.state_slot for s in seqs] if runner.cache.states is not None else None, device=runner.device)


def _kernel_seconds(fn, device: str, reps: int = 3) -> float | str | None:
    """Summed device time of the CUDA kernels (and copies) one call of `fn` launches, from the
    profiler; None off CUDA, the error's text if the profiler fails (the other timings stand)."""
    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
    except RuntimeError as e:
        return f"profiler failed: {e}"[:200]
    total_us = sum(getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
                   for ev in prof.key_averages())
    return total_us / 1e6 / reps if total_us > 0 else "the profiler saw no kernels"


def _isolated(st: State, decode: bool) -> dict:
    """One scheduled step, executed again and again by the runner alone, by the decode graph
    replay alone (decode steps, when the engine captured graphs) and by the eager model alone."""
    eng, device, reps = st.engine, st.device, st.sizes.reps
    plan = eng.scheduler.schedule()
    last = []
    out = {"plan_tokens": plan.num_tokens,
           "runner_run": timeit(lambda: last.append(eng.runner.run(plan)), device, warmup=2, reps=reps)}
    graphs = eng.runner.graphs
    if decode and graphs is not None and graphs.bucket(len(plan.seqs)) is not None:
        seqs = plan.seqs
        args = ([q.token_ids[0] for q in seqs], [q.context_before for q in seqs], [q.block_table[0] for q in seqs],
                [q.state_slot for q in seqs])
        out["graph_replay"] = timeit(lambda: graphs.run(*args), device, warmup=2, reps=reps)
        out["graph_replay_kernel_s"] = _kernel_seconds(lambda: graphs.run(*args), device)
    model, cache = eng.runner.model, eng.runner.cache
    batch = _forward_batch(eng.runner, plan)

    def forward():
        with torch.inference_mode():
            return model.forward(batch, cache)

    out["model_forward"] = timeit(forward, device, warmup=2, reps=reps)  # eager: op by op
    out["forward_kernel_s"] = _kernel_seconds(forward, device)
    eng.scheduler.update(plan, last[-1])
    return out


def section_decode(st: State, batch: int, hbm: float | None, matmul: float | None, sampled: bool = False) -> dict:
    st.check_time()
    eng, s = st.engine, st.sizes
    tag = "s" if sampled else "g"
    seqs = [eng.add(_request(st, f"d{batch}{tag}-{i}", s.context, i, sampled)) for i in range(batch)]
    prefill_steps = 0
    while any(q.num_output_tokens == 0 for q in seqs):
        eng.step()
        prefill_steps += 1
    stats = eng.experts.stats
    lookups, warm = stats.total_lookups, 3
    t_step = timeit(eng.step, st.device, warmup=warm, reps=s.reps)
    distinct = (stats.total_lookups - lookups) / (warm + s.reps)  # (layer, expert) pairs read per step
    iso = _isolated(st, decode=True)
    t_pipe = daemon_loop(eng, warm, 2 * s.reps)  # last: it ends the requests
    context = s.context + 1 + (warm + 3 * s.reps) / 2  # mean tokens before a timed step's new one
    eng.settle()
    floor = decode_floor(st.rad, batch, context, distinct, hbm, matmul)
    f = floor["floor_s"]
    return {"batch": batch, "sampled": sampled, "prompt_tokens": s.context, "mean_context": context,
            "prefill_steps": prefill_steps,
            "engine_step": t_step, "pipelined_step": t_pipe, **iso, "distinct_experts_per_step": distinct, **floor,
            "ratio_floor_over_step": f / t_pipe["mean_s"] if f else None,
            "ratio_floor_over_sequential_step": f / t_step["median_s"] if f else None,
            "ratio_floor_over_graph": f / iso["graph_replay"]["median_s"] if f and "graph_replay" in iso else None,
            "tokens_per_s": batch / t_pipe["mean_s"]}


class _StepClock(NoMetrics):
    """The driver's metrics, reduced to what a timing needs: the wall time when step n ended (observed
    on the step thread; the loop's event set through the loop)."""

    def __init__(self, marks: dict[int, asyncio.Event]):
        self.marks, self.steps, self.ended = marks, 0, {}
        self.loop = asyncio.get_running_loop()

    def observe_step(self, seconds: float) -> None:
        self.steps += 1
        if self.steps in self.marks:
            self.ended[self.steps] = time.perf_counter()
            self.loop.call_soon_threadsafe(self.marks[self.steps].set)


def daemon_loop(eng, warmup: int, reps: int) -> dict:
    """Seconds per step of the daemon's own loop: `AsyncEngine.run` (engine/driver.py: the rounds on
    its step thread beside the daemon's event loop, uvloop; step N+1 launched before step N is
    collected), over the requests already in the scheduler: the wall time between the ends of step
    `warmup` and step `warmup + reps`, in steady state. Then the requests are ended and the driver
    stops idle (nothing left in flight)."""
    async def run() -> float:
        marks = {warmup: asyncio.Event(), warmup + reps: asyncio.Event()}
        clock = _StepClock(marks)
        loop = AsyncEngine(eng, clock)
        task = asyncio.create_task(loop.run())
        await marks[warmup + reps].wait()
        seconds = clock.ended[warmup + reps] - clock.ended[warmup]
        await loop.between_steps(eng.scheduler.abort_all)
        while eng.in_flight is not None:
            await asyncio.sleep(0.001)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return seconds

    seconds = uvloop.run(run())  # the daemon runs on uvloop (daemon.main)
    return {"mean_s": seconds / reps, "reps": reps, "warmup": warmup, "timer": "perf_counter, steady state",
            "loop": f"{AsyncEngine.__module__}.{AsyncEngine.__qualname__}.run"}


def section_prefill(st: State, matmul: float | None) -> dict:
    """One prompt of `prefill` tokens, prefilled in one step: each repetition a fresh prompt."""
    st.check_time()
    eng, n, device = st.engine, st.sizes.prefill, st.device
    times = []
    for i in range(4):  # the first warms up (compiles)
        eng.add(_request(st, f"p{i}", n, i))
        _sync(device)
        t0 = time.perf_counter()
        eng.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
        steps = 1
        while eng.scheduler.num_waiting or any(q.is_prefilling for q in eng.scheduler.running):
            eng.step()
            steps += 1
        eng.scheduler.abort_all()
        eng.settle()
        if steps != 1:
            raise AssertionError(f"the {n}-token prompt took {steps} steps; raise --max-num-batched-tokens")
    eng.add(_request(st, "p-iso", n, 9))
    iso = _isolated(st, decode=False)
    eng.scheduler.abort_all()
    eng.settle()
    flop = prefill_flop(st.rad.model, n, _layer_matmul_params(st.rad))
    timed = sorted(times[1:])
    step = timed[len(timed) // 2]
    return {"tokens": n, "engine_step_s": times, "median_s": step, "flop": flop, "flop_per_s": flop / step,
            "matmul_flop_per_s": matmul, "ratio": flop / step / matmul if matmul else None, **iso,
            "forward_flop_per_s": flop / iso["model_forward"]["median_s"]}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _layer_matmul_params(rad) -> int:
    """Elements of the decoder layers' matrices (q/k/v/o, routers); routed experts are not tensors."""
    return sum(math.prod(t.shape) for t in rad.header.tensors
               if t.name.startswith("model.layers.") and len(t.shape) == 2)


def prefill_flop(m, tokens: int, layer_params: int) -> int:
    """FLOP of one sequence's prefill: every matmul, causal attention, top_k experts per token, one lm_head row."""
    experts = tokens * m.num_experts_per_tok * 6 * m.moe_intermediate_size * m.hidden_size * len(m.moe_layers)
    attention = 2 * m.num_attention_heads * m.head_dim * tokens * (tokens + 1) * len(m.full_attention_layers)
    return 2 * tokens * layer_params + experts + attention + 2 * m.vocab_size * m.hidden_size


def decode_floor(rad, batch: int, context: float, distinct: float, hbm: float | None, matmul: float | None) -> dict:
    """The least one decode step must move and compute (bytes: each weight once, the context's K and V once)."""
    m = rad.model
    elem = rad.tensor("model.embed_tokens.weight", verify=False).element_size()
    sizes = {t.name: t.nbytes for t in rad.header.tensors}
    dense = sum(v for k, v in sizes.items() if k.startswith("model.layers."))
    experts = distinct * rad.header.experts[0].nbytes
    kv = batch * len(m.full_attention_layers) * (context + 2) * 2 * m.num_key_value_heads * m.head_dim * elem
    head = sizes["lm_head.weight"] + sizes["model.norm.weight"] + batch * m.hidden_size * elem
    nbytes = dense + experts + kv + head
    flop = batch * (2 * _layer_matmul_params(rad) + 2 * m.vocab_size * m.hidden_size
                    + len(m.moe_layers) * m.num_experts_per_tok * 6 * m.moe_intermediate_size * m.hidden_size
                    + len(m.full_attention_layers) * 4 * m.num_attention_heads * m.head_dim * (context + 1))
    floors = {}
    if hbm:
        floors["bytes"] = nbytes / hbm
    if matmul:
        floors["flop"] = flop / matmul
    return {"min_bytes": nbytes, "bytes_parts": {"dense_layers": dense, "experts": experts, "kv": kv,
                                                 "embedding_rows_lm_head_norm": head},
            "flop": flop, "floors_s": floors, "floor_s": max(floors.values()) if floors else None,
            "floor_kind": max(floors, key=floors.get) if floors else None}


def section_release(st: State) -> dict:
    """Drop the engine (its arena and experts) before transformers takes the card."""
    st.engine = None
    gc.collect()
    if st.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return {"allocated_after": torch.cuda.memory_allocated()}
    return {}


# -- transformers ---------------------------------------------------------------------------------


def section_hf_build(st: State) -> dict:
    st.check_time()
    import transformers
    from transformers import AutoModelForCausalLM

    from tools.peer_transformers import hf_config

    cfg = hf_config(st.rad.model)
    t0 = time.perf_counter()
    with torch.device(st.device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16).eval()
    g = torch.Generator(device=st.device).manual_seed(1)
    with torch.no_grad():  # random weights at a trained model's scale (the router too: init leaves it zero)
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02, generator=g)
            else:
                p.fill_(1.0)
    _sync(st.device)
    st.hf = model
    return {"transformers": transformers.__version__, "seconds": time.perf_counter() - t0,
            "attn_implementation": model.config._attn_implementation,
            "experts_implementation": getattr(model.config, "_experts_implementation", None),
            "parameters": sum(p.numel() for p in model.parameters())}


def section_hf_decode(st: State, batch: int) -> dict:
    st.check_time()
    from transformers import DynamicCache

    model, s, device = st.hf, st.sizes, st.device
    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated")  # `cache=` is new in 5.24
    ids = torch.tensor([st.prompt(s.context) for _ in range(batch)], device=device)
    cache = DynamicCache(config=model.config)
    state = {}
    with torch.inference_mode():
        _sync(device)
        t0 = time.perf_counter()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        state["next"] = out.logits[:, -1].argmax(-1, keepdim=True)
        _sync(device)
        prefill_s = time.perf_counter() - t0

        def step():
            o = model(input_ids=state["next"], past_key_values=cache, use_cache=True)
            state["next"] = o.logits[:, -1].argmax(-1, keepdim=True)

        t = timeit(step, device, warmup=2, reps=min(s.reps, 10))
    return {"batch": batch, "prompt_tokens": s.context, "prefill_s": prefill_s, "decode_step": t,
            "tokens_per_s": batch / t["median_s"]}


# -- report -----------------------------------------------------------------------------------------


def report_rows(res: dict) -> list[tuple[str, str, str, str, str]]:
    """(row, measured, floor or reference from the same run, ratio, note)."""
    rows = []
    c = res.get("ceilings", {})
    cp, mm = c.get("hbm_copy", {}), c.get("matmul_bf16", {})
    hbm, flops = cp.get("bytes_per_s"), mm.get("flop_per_s")
    rows.append((f"device copy {_mib(cp.get('bytes'))} (read+write)", _rate(hbm), "", "",
                 ("ceiling " + _why(cp)).strip()))
    rows.append((f"bf16 matmul {mm.get('n', '?')}^3", _rate(flops, "FLOP/s"), "", "",
                 ("ceiling " + _why(mm)).strip()))
    md = res.get("model", {})
    layers = f"{md.get('layers', '?')} of {REAL_LAYERS} layers"
    batches = res.get("sizes", {}).get("batches", ())
    for key in [f"decode_b{b}" for b in batches] + ["decode_b1_sampled"]:
        d = res.get(key, {})
        if d.get("status") != "ok":
            rows.append((f"{key}: Engine.step", "-", "", "", _why(d)))
            continue
        rows.append((
            f"decode b{d['batch']} {'sampled (temperature 1)' if d['sampled'] else 'greedy'}, Qwen3-30B-A3B shapes "
            f"({layers} + lm_head), ctx {d['prompt_tokens']:,}, all experts resident: "
            "the daemon's loop (AsyncEngine.run, pipelined)",
            f"{_ms(d['pipelined_step']['mean_s'])} ({d['tokens_per_s']:,.0f} tok/s)",
            f"{_ms(d['floor_s'])} ({d['floor_kind']})", _pct(d["ratio_floor_over_step"]),
            _decode_note(d) + (" (target >= 60% at b1)" if d["batch"] == 1 and not d["sampled"] else "")))
    p = res.get("prefill", {})
    if p.get("status") == "ok":
        kern = p.get("forward_kernel_s")
        rows.append((f"prefill {p['tokens']:,} tokens, one sequence ({layers} + lm_head): Engine.step",
                     f"{_ms(p['median_s'])} ({_rate(p['flop_per_s'], 'FLOP/s')})",
                     f"matmul {_rate(p['matmul_flop_per_s'], 'FLOP/s')}", _pct(p["ratio"]),
                     f"{p['flop'] / 1e9:,.1f} GFLOP; eager model.forward {_ms(p['model_forward']['median_s'])} "
                     f"({_rate(p['forward_flop_per_s'], 'FLOP/s')})"
                     + (f", its kernels {_ms(kern)}" if isinstance(kern, float) else "")))
    else:
        rows.append(("prefill", "-", "", "", _why(p)))
    hb = res.get("hf_build", {})
    for b in batches:
        h, ours = res.get(f"hf_decode_b{b}", {}), res.get(f"decode_b{b}", {})
        if h.get("status") != "ok":
            rows.append((f"transformers decode b{b}", "-", "", "", _why(h)))
            continue
        ratio = ours["tokens_per_s"] / h["tokens_per_s"] if ours.get("status") == "ok" else None
        rows.append((
            f"transformers {hb.get('transformers', '?')} decode b{h['batch']}, same config, ctx {h['prompt_tokens']:,}",
            f"{_ms(h['decode_step']['median_s'])} ({h['tokens_per_s']:,.1f} tok/s)",
            f"ours {ours.get('tokens_per_s', 0):,.0f} tok/s" if ratio else "",
            f"ours/theirs {ratio:.1f}x" if ratio else "-",
            f"attn {hb.get('attn_implementation')}, experts {hb.get('experts_implementation')}"
            + ("; target >= 20x at b1" if h["batch"] == 1 else "")))
    return rows


def _decode_note(d: dict) -> str:
    """The same step's parts: runner alone, graph replay alone, eager forward; bytes and experts."""
    parts = [f"Engine.step (sequential) {_ms(d['engine_step']['median_s'])} "
             f"({_pct(d['ratio_floor_over_sequential_step'])} of floor)", f"runner.run {_ms(d['runner_run']['median_s'])}"]
    if "graph_replay" in d:
        kern = d.get("graph_replay_kernel_s")
        parts.append(f"decode graph replay {_ms(d['graph_replay']['median_s'])} "
                     f"({_pct(d['ratio_floor_over_graph'])} of floor"
                     + (f"; kernels {_ms(kern)})" if isinstance(kern, float) else ")"))
    kern = d.get("forward_kernel_s")
    parts.append(f"eager model.forward {_ms(d['model_forward']['median_s'])}"
                 + (f" (kernels {_ms(kern)})" if isinstance(kern, float) else ""))
    return (", ".join(parts) + f"; {_mib(d['min_bytes'])} moved at least, "
            f"{d['distinct_experts_per_step']:.0f} distinct experts/step")


def _why(sec: dict) -> str:
    """Why a section has no numbers ("" when it has them)."""
    if sec.get("status") == "ok":
        return ""
    if "status" not in sec:
        return "not run (not asked for with --only, or a section it needs failed)"
    return f"{sec['status']}: {(sec.get('error') or sec.get('why') or '')[:150]}"


def _pct(x: float | None) -> str:
    return f"{x:.1%}" if x else "-"


def write_report(out: Path, res: dict) -> str:
    env = res.get("env", {})
    title = (f"radianced bench_model: {env.get('date_utc', '?')}, {env.get('device', '?')}, "
             f"commit {env.get('commit', '?')}, fingerprint {env.get('fingerprint', '?')}, torch {env.get('torch')}")
    lines = [f"## {title}", ""]
    if res.get("quick"):
        lines += ["> **Quick run (width / 16, tiny contexts" + ("" if res.get("device") == "cuda" else ", on the CPU")
                  + "): these numbers prove the code paths, nothing about speed.**", ""]
    lines += ["| row | measured | floor / reference (same run) | ratio | note |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in report_rows(res)]
    text = "\n".join(lines) + "\n"
    (out / "bench_model.md").write_text(text)
    return text


# -- driver --------------------------------------------------------------------------------------------


def section_env(device: str) -> dict:
    import datetime as dt

    env = {"date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "torch": torch.__version__,
           **commit(), "fingerprint": fingerprint()}
    env["device"] = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--layers", type=int, help="decoder layers of the synthetic model (default 8; quick 2)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (automatic without CUDA)")
    ap.add_argument("--time-limit", type=float, default=185.0, help="seconds; later sections are skipped past it")
    ap.add_argument("--only", action="append", choices=PARTS,
                    help="run only these parts (repeatable; default all): " + ", ".join(PARTS))
    args = ap.parse_args(argv)
    parts = set(args.only or PARTS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    quick = args.quick or device == "cpu"
    st = State(device, Sizes.pick(quick, args.layers), time.monotonic() + args.time_limit)
    path = out / "bench_model.json"
    res: dict = {"quick": quick, "device": device, "sizes": st.sizes.__dict__}
    _section(res, path, "env", section_env, device)
    ceil: dict = {}
    res["ceilings"] = ceil
    _section(ceil, path, "hbm_copy", ceiling_copy, device, st.sizes.copy_bytes)
    _section(ceil, path, "matmul_bf16", ceiling_matmul, device, st.sizes.matmul_n)
    hbm, matmul = ceil["hbm_copy"].get("bytes_per_s"), ceil["matmul_bf16"].get("flop_per_s")
    with tempfile.TemporaryDirectory(prefix="radianced-model-", dir=model_dir(st.sizes.layers)) as tmp:
        if _section(res, path, "model", section_model, st, Path(tmp))["status"] == "ok":
            if _section(res, path, "engine", section_engine, st)["status"] == "ok":
                for b in st.sizes.batches if "decode" in parts else ():
                    _section(res, path, f"decode_b{b}", section_decode, st, b, hbm, matmul)
                if "decode" in parts:  # the b1 step again with the sampler's work (temperature 1)
                    _section(res, path, "decode_b1_sampled", section_decode, st, 1, hbm, matmul, True)
                if "prefill" in parts:
                    _section(res, path, "prefill", section_prefill, st, matmul)
            _section(res, path, "release", section_release, st)
            if "transformers" in parts and _section(res, path, "hf_build", section_hf_build, st)["status"] == "ok":
                for b in st.sizes.batches:
                    _section(res, path, f"hf_decode_b{b}", section_hf_decode, st, b)
            st.hf = None
            st.rad.close()
    print(write_report(out, res), flush=True)
    bad = [k for k, v in {**ceil, **res}.items() if isinstance(v, dict) and v.get("status") in ("error", "failed")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
