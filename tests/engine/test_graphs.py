"""The decode-graph path's layout on the CPU: `DecodeGraphs(capture=False)` runs the padded
static batch eagerly, so the tokens, the expert accounting and the KV it writes must equal
the plain eager runner's. (The capture and replay themselves are checked on the GPU:
tests/gpu/test_decode_graphs.py.)
"""

from __future__ import annotations

import pytest

from radianced.budget import BLOCK_TOKENS, Card
from radianced.config import Config
from radianced.engine.engine import Engine
from radianced.engine.graphs import DecodeGraphs, buckets_for
from tests.engine.conftest import prompts, request, run_all

CFG = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)


def test_buckets_end_at_max_num_seqs():
    assert buckets_for(1) == (1,)
    assert buckets_for(4) == (1, 2, 4)
    assert buckets_for(40) == (1, 2, 4, 8, 16, 24, 32, 40)


@pytest.mark.parametrize("family, flags", [("llama", {}), ("qwen3_moe", dict(host_pool_mib=1, expert_slots=6))])
def test_padded_static_decode_batches_give_the_eager_tokens_and_counts(tiny_rads, family, flags):
    rad = tiny_rads[family]
    ps = prompts(rad.model.vocab_size, (9, 33, 50), seed=51)  # 3 sequences: bucket 4, one padding row
    runs = []
    for graphs in (False, True):
        engine = Engine.build(rad, Config(**CFG, **flags), Card.from_mib(256))
        runner = engine.runner
        if graphs:
            runner.graphs = DecodeGraphs(runner.model, runner.cache, 4, 256 // BLOCK_TOKENS, engine.experts,
                                         capture=False)
        tokens = run_all(engine, [request(engine, f"p{i}", p, max_tokens=12) for i, p in enumerate(ps)])
        stats = engine.experts.stats if engine.experts is not None else None
        runs.append((tokens, stats and (stats.lookups, stats.hits, stats.routed)))
    assert runs[0] == runs[1]
