"""Decode steps replayed from CUDA graphs give the eager path's tokens and expert counts.

Tiny llama, qwen3_moe and qwen3_next (fp32; experts split between slots and the
host pool; qwen3_next's padding rows carry recurrent-state slot -1), built by
`Engine.build` on the device twice: with the decode graphs it captures,
and with `--enforce-eager`. `--deterministic` makes the MoE scatter a fixed-order
sum, so both paths compute the same bits and greedy decoding cannot part on a
rounding difference. The mean decode step time of both paths is recorded.
The same engines with graphs, stepped by the daemon's pipelined loop, give the
sequential loop's tokens, greedy and with penalties (computed on the device).
"""

from __future__ import annotations

import time

import pytest
import torch

from radianced.card import Card
from radianced.config import Config
from radianced.engine.engine import Engine
from tests.engine.conftest import prompts, request, tiny_rads  # noqa: F401 (fixture)
from tests.gpu.conftest import gpu_device, record

EXPERTS = dict(host_pool_mib=1, expert_slots=6)
FLAGS = {"llama": {}, "qwen3_moe": EXPERTS, "qwen3_next": EXPERTS}


def serve(engine: Engine, ps) -> tuple[dict, float]:
    """Greedy tokens per request and the mean time of the all-decode steps."""
    for i, p in enumerate(ps):
        engine.add(request(engine, f"p{i}", p, max_tokens=24, ignore_eos=True))
    out, times = {}, []
    while engine.scheduler.has_unfinished:
        decode = all(s.num_computed_tokens for s in engine.scheduler.running) and not engine.scheduler.waiting
        t0 = time.perf_counter()
        events = engine.step()
        if decode:
            times.append(time.perf_counter() - t0)
        for ev in events:
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
    return out, sum(times) / max(1, len(times))


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "qwen3_next"])
def test_graph_replay_gives_the_eager_tokens(tiny_rads, family):  # noqa: F811
    device = gpu_device()
    if device != "cuda":
        pytest.skip("CUDA graphs need CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False
    rad = tiny_rads[family]
    ps = prompts(rad.model.vocab_size, (5, 17, 40), seed=61)  # 3 sequences: bucket 4, one padding row
    runs = {}
    for eager in (True, False):
        cfg = Config(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, deterministic=True,
                     enforce_eager=eager, **FLAGS[family])
        engine = Engine.build(rad, cfg, Card.from_mib(1024), device)
        assert (engine.runner.graphs is None) == eager
        tokens, step = serve(engine, ps)
        stats = engine.experts.stats if engine.experts is not None else None
        runs[eager] = (tokens, stats and (stats.lookups, stats.hits, stats.routed), step)
    assert runs[False][:2] == runs[True][:2]
    record({"test": "decode_graphs", "family": family, "eager_step_s": runs[True][2],
            "graph_step_s": runs[False][2]})


PENALTIES = dict(repetition_penalty=3.0, frequency_penalty=0.5, presence_penalty=0.2)


@pytest.mark.parametrize("penalties", [False, True], ids=["greedy", "penalties"])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "qwen3_next"])
def test_pipelined_graph_steps_give_the_sequential_tokens(tiny_rads, family, penalties):  # noqa: F811
    """The daemon's loop on the device: plans made ahead feed each decode its input token from
    the previous step's sampled tokens on the device (a gather into the graph's inputs before
    the replay); greedy tokens must be the sequential engine's. With strong penalties (which
    decide tokens), a PENDING output is counted from those device-side samples and the
    histories are scattered on the device: a miscounted token changes the tokens."""
    device = gpu_device()
    torch.backends.cuda.matmul.allow_tf32 = False
    rad = tiny_rads[family]
    ps = prompts(rad.model.vocab_size, (5, 17, 40), seed=62)
    runs = {}
    for pipelined in (False, True):
        cfg = Config(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, deterministic=True,
                     **FLAGS[family])
        engine = Engine.build(rad, cfg, Card.from_mib(1024), device)
        assert (engine.runner.graphs is not None) == (device == "cuda")
        for i, p in enumerate(ps):
            engine.add(request(engine, f"p{i}", p, max_tokens=24, ignore_eos=True, **(PENALTIES if penalties else {})))
        out: dict = {}
        while engine.scheduler.has_unfinished:
            for ev in engine.step(ahead=pipelined):
                out.setdefault(ev.request_id, []).extend(ev.token_ids)
        runs[pipelined] = out
    assert runs[True] == runs[False]
