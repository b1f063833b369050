"""A compact model under `--tp 2` on the CPU, two real processes over gloo: rank 0 is this test process
(`Engine.build` over its card), rank 1 a spawned worker (`WorkerShard.for_card`).

Each card loads its part of every compact matrix in its blocks, as one card does with the whole, and
holds exactly the weights its receipt charges (sharding.shard_facts splits a file's facts tensor by
tensor). Both cases give one card's greedy tokens, the logits within fp32 rounding of them:

- fp8_b128 layers, q4_0 experts and a q8_0 table and lm_head (the CPU dequantizes fp8 per use in fp32);
- q4_0 layers, which each card's block kernels read in place (kernels/cpu_blocks.py: fp32, the
  dequantized values), a row-parallel o_proj or down_proj summed over the two cards in another order.

One spawn for the module: the worker takes one job a model (the .rad and the flags), serves that
engine's steps until it closes, then sends back the bytes its model held.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from radianced.card import Card
from radianced.config import Config
from radianced.engine.engine import Engine
from radianced.engine.tp_workers import WorkerShard
from radianced.kernels.compact import CompactWeight
from radianced.kernels.formats import CPU_BLOCKS
from radianced.model.convert import convert
from radianced.model.rad import RadFile
from radianced.model.tiny import make_tiny
from tests.engine.conftest import prompts, request, run_all
from tests.engine.tp_ranks import jobs, two_ranks
from tests.test_sizing_compact import _held_bytes

FP8 = "experts=int4,layers=fp8,embeddings=int8"  # the tiny models' matrices: parts inside one fp8 block
BLOCKS = "layers=int4,embeddings=int8"
CFG = dict(card_mib=256, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
TOLERANCE = 1e-4  # measured: 3e-6 (fp32, partial sums in another order)


def _worker(rank: int, port: int) -> None:
    for group, (path, flags) in jobs(rank, port):
        shard = WorkerShard.for_card(RadFile.open(path), Config(**flags), group)
        held, blocks = _held_bytes(shard.model, set()), _blocks(shard.model)
        shard.serve_steps()
        dist.broadcast_object_list([(held, blocks)], src=1)


@pytest.fixture(scope="module")
def group():
    with two_ranks(_worker) as g:
        yield g


@pytest.fixture(scope="module")
def compact_rad(tmp_path_factory):
    def make(family: str, quantize: str) -> RadFile:
        src = make_tiny(family, tmp_path_factory.mktemp(family))
        convert(src, src / "q.rad", quantize=quantize)
        return RadFile.open(src / "q.rad")

    return make


def _blocks(model) -> list[tuple[int, int]]:
    """(rows, input columns) of every attention and dense MLP matrix the model holds in a format the block
    kernels read ([q | k | v], o_proj, down_proj)."""
    return [w.shape for block in model.layers for w in (block.attn.wqkv, block.attn.wo, getattr(block.mlp, "down", 0))
            if isinstance(w, CompactWeight) and w.fmt in CPU_BLOCKS]


def _serve(engine: Engine, ps: list[list[int]], tokens: int):
    """Every prompt at once, greedy; (tokens per request id, each step's logits)."""
    logits, forward = [], engine.runner.model.forward
    engine.runner.model.forward = lambda *a, **k: (out := forward(*a, **k), logits.append(out.clone()))[0]
    got = run_all(engine, [request(engine, f"r{i}", p, max_tokens=tokens, ignore_eos=True) for i, p in enumerate(ps)])
    return got, logits


def _charged(receipt) -> int:
    """The weights a CPU card's receipt charges (the embedding table's part in host RAM; not the expert
    read staging, which is no weight)."""
    return receipt.weights_bytes + sum(p.bytes for p in receipt.host_weights if p.name == "embeddings")


@pytest.mark.parametrize("family,quantize", [("llama", FP8), ("qwen3_moe", FP8), ("llama", BLOCKS)])
def test_a_compact_model_gives_one_cards_tokens_and_each_card_holds_its_receipts_weights(
        compact_rad, group, family, quantize):
    tokens = 8
    rad = compact_rad(family, quantize)
    assert isinstance(rad.tensor("model.layers.0.self_attn.o_proj.weight"), CompactWeight)
    ps = prompts(rad.model.vocab_size, (30, 7, 19), seed=11)
    want, want_logits = _serve(Engine.build(rad, Config(**CFG), Card.from_mib(256, cuda=False)), ps, tokens)
    dist.broadcast_object_list([(str(rad.path), {**CFG, "tp": 2})], src=0)
    two = Engine.build(rad, Config(**CFG, tp=2), group=group)
    held0, blocks0 = _held_bytes(two.runner.model, set()), _blocks(two.runner.model)
    got, logits = _serve(two, ps, tokens)
    two.close()
    answer = [None]
    dist.broadcast_object_list(answer, src=1)
    (held1, blocks1), receipts = answer[0], two.cards.receipts
    assert got == want and all(len(t) == tokens for t in got.values())
    diff = max((x - y).abs().max().item() for x, y in zip(logits, want_logits) if x.numel())
    assert diff <= TOLERANCE, f"logits of --tp 2 differ from --tp 1 by {diff}"
    assert [held0, held1] == [_charged(r) for r in receipts]
    if quantize == BLOCKS:  # each card's q | k | v rows, o_proj's 32 of 64 input columns, down_proj's 64 of 128
        assert blocks0 == blocks1 == [(64 // 2 + 2 * 16, 64), (64, 32), (64, 64)] * rad.model.num_hidden_layers
