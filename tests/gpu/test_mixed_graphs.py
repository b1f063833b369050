"""Steps that are not decode-shaped, replayed from the mixed CUDA graphs, give the eager path's tokens
and expert counts (engine/graphs.py, graph_shapes.py).

Tiny llama and qwen3_moe (fp32, experts split between slots and the host pool), built by
`Engine.build` on the device twice, with its step graphs and with `--enforce-eager`,
`--deterministic` so both compute the same bits. Three prompts under a 64-token step budget
(chunks of prefill beside decodes, whole short prompts: mixed buckets 16, 32, 64) and a fourth
arriving mid-run, and the same with prompts of 120-450 tokens under a 520-token budget (the buckets
past 256 tokens); then --speculative 3 with every decode drafting (verify steps of 4 rows a
sequence). Each step's time is recorded by kind (mixed replays against eager steps of the same
plan). Qwen3-Next captures mixed graphs for its verify steps alone (none without drafts): replayed, they
give the eager tokens, its prompts' chunks running eagerly.
"""

from __future__ import annotations

import time

import pytest
import torch

from radianced.card import Card
from radianced.config import Config
from radianced.engine.engine import Engine
from radianced.engine.warmup import forced_drafting
from tests.engine.conftest import prompts, request, tiny_rads  # noqa: F401 (fixture)
from tests.gpu.conftest import gpu_device, record

EXPERTS = dict(host_pool_mib=1, expert_slots=6)
FLAGS = {"llama": {}, "qwen3_moe": EXPERTS}


def _cuda() -> str:
    device = gpu_device()
    if device != "cuda":
        pytest.skip("CUDA graphs need CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False
    return device


def serve(engine: Engine, ps, late=None, draft=False) -> tuple[dict, list[float], int]:
    """Greedy tokens per request, each step's seconds, and how many steps ran a mixed graph."""
    mixed = [0]
    if engine.runner.graphs is not None:
        replay = engine.runner.graphs.run_mixed

        def counted(layout, pending=None, state_slots=None):
            mixed[0] += 1
            return replay(layout, pending, state_slots)

        engine.runner.graphs.run_mixed = counted
    if draft:
        engine.scheduler.drafting = forced_drafting(engine.scheduler.drafting)
    for i, p in enumerate(ps):
        engine.add(request(engine, f"p{i}", p, max_tokens=16, ignore_eos=True))
    out, times, steps = {}, [], 0
    while engine.scheduler.has_unfinished:
        t0 = time.perf_counter()
        events = engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        steps += 1
        if late is not None and steps == 3:
            engine.add(request(engine, "late", late, max_tokens=16, ignore_eos=True))
        for ev in events:
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
    return out, times, mixed[0]


# (step budget, prompt lengths, the mixed buckets): small steps; long prompts in the buckets past 256 tokens
# (multiples of 256, and the budget itself)
SHAPES = {"small": (64, (9, 33, 50, 21), (16, 32, 64)),
          "long": (520, (300, 450, 120, 21), (16, 32, 64, 128, 256, 512, 520))}


@pytest.mark.parametrize("shape", ["small", "long"])
@pytest.mark.parametrize("speculative", [0, 3])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_mixed_graph_replays_give_the_eager_tokens(tiny_rads, family, speculative, shape):  # noqa: F811
    device = _cuda()
    rad = tiny_rads[family]
    budget, lengths, buckets = SHAPES[shape]
    ps = prompts(rad.model.vocab_size, lengths, seed=62)
    runs = {}
    for eager in (True, False):
        cfg = Config(max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=budget, deterministic=True,
                     enforce_eager=eager, speculative=speculative, **FLAGS[family])
        engine = Engine.build(rad, cfg, Card.from_mib(1024), device)
        if not eager:
            assert engine.runner.graphs.mixed == buckets
        tokens, times, mixed = serve(engine, ps[:3], late=ps[3], draft=bool(speculative))
        stats = engine.experts.stats if engine.experts is not None else None
        runs[eager] = (tokens, stats and (stats.lookups, stats.hits, stats.routed), times, mixed)
        engine.close()
    (eager_tokens, eager_counts, eager_times, _), (tokens, counts, times, mixed) = runs[True], runs[False]
    record({"test": "mixed_graphs", "family": family, "speculative": speculative, "shape": shape, "mixed_steps": mixed,
            "steps": len(times), "eager_step_ms": [round(1e3 * t, 3) for t in eager_times],
            "graph_step_ms": [round(1e3 * t, 3) for t in times]})
    assert tokens == eager_tokens and counts == eager_counts
    assert mixed >= 3


def test_a_hybrid_model_replays_its_verify_steps_alone_from_mixed_graphs(tiny_rads):  # noqa: F811
    device = _cuda()
    rad = tiny_rads["qwen3_next"]
    base = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, deterministic=True, **EXPERTS)
    engine = Engine.build(rad, Config(**base), Card.from_mib(1024), device)
    assert engine.runner.graphs is not None and engine.runner.graphs.mixed == ()  # no drafts: decode graphs only
    engine.close()
    ps = prompts(rad.model.vocab_size, (9, 33, 50, 21), seed=62)
    runs = {}
    for eager in (True, False):
        engine = Engine.build(rad, Config(**base, enforce_eager=eager, speculative=3), Card.from_mib(1024), device)
        if not eager:
            assert engine.runner.graphs.mixed == (16,)  # 4 sequences x (1 + 3 drafts)
        tokens, times, mixed = serve(engine, ps[:3], late=ps[3], draft=True)
        runs[eager] = (tokens, times, mixed)
        engine.close()
    (eager_tokens, eager_times, _), (tokens, times, mixed) = runs[True], runs[False]
    record({"test": "mixed_graphs", "family": "qwen3_next", "speculative": 3, "shape": "small", "mixed_steps": mixed,
            "steps": len(times), "eager_step_ms": [round(1e3 * t, 3) for t in eager_times],
            "graph_step_ms": [round(1e3 * t, 3) for t in times]})
    assert tokens == eager_tokens and mixed >= 3
