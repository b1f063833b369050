"""One rank's share of a `.rad` (model/sharded_loader.py): the slices of every rank add up to the
whole tensor, a compact one's parts in its format (their dequantizations make up the whole's), and
what the split cannot run is refused by name. The forward over 2 processes is
tests/engine/test_tp_workers.py's (tests/engine/test_tp_compact.py's for compact models)."""

from __future__ import annotations

import pytest
import torch

from radianced.budget import PlanError
from radianced.card import Card
from radianced.config import Config
from radianced.kernels.compact import CompactWeight
from radianced.kernels.dequant import split_fp8_b128
from radianced.model.convert import convert
from radianced.model.parallel import ProcessGroup
from radianced.model.rad import RadFile
from radianced.model.rad_format import RadError
from radianced.model.sharded_loader import load_shard, owned_experts, shard_tensor
from radianced.model.tiny import FAMILIES, make_tiny
from radianced.sharding import ROW_PARALLEL, card_share, split_kind
from radianced.sizing import ModelFacts
from radianced.tp_plan import plan_cards


def _rad(tmp_path, family, quantize: str | None = None, **overrides) -> RadFile:
    src = make_tiny(family, tmp_path / family, **overrides)
    convert(src, src / "model.rad", quantize=quantize)
    return RadFile.open(src / "model.rad")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_ranks_slices_make_up_each_tensor(tmp_path, family):
    rad = _rad(tmp_path, family)
    m = rad.model
    shares = [card_share(m, r, 2) for r in range(2)]
    for name in rad.tensor_names():
        whole = rad.tensor(name)
        parts = [shard_tensor(whole, name, m, s) for s in shares]
        if split_kind(name) == "replicated":
            assert all(p is whole for p in parts), name
        elif name.endswith("conv1d.weight"):  # [q | k | v] channels: each rank's of each third
            assert sum(p.shape[0] for p in parts) == whole.shape[0]
            assert {tuple(row.flatten().tolist()) for p in parts for row in p} == \
                {tuple(row.flatten().tolist()) for row in whole}, name
        else:
            assert torch.equal(torch.cat(parts, dim=1 if name.endswith(ROW_PARALLEL) else 0), whole), name


def test_each_rank_holds_its_own_experts(tmp_path):
    rad = _rad(tmp_path, "qwen3_moe")
    share = card_share(rad.model, 1, 2)  # experts 4-7 of 8
    experts = owned_experts(rad, share)
    assert experts.slab.shape[0] == 4 * rad.model.num_hidden_layers
    for layer in range(rad.model.num_hidden_layers):
        table = experts.table(layer)
        for e in range(4, 8):
            gate, up, down = rad.expert(layer, e)
            assert torch.equal(experts.slab[table[e]], torch.cat((gate.flatten(), up.flatten(), down.flatten())))


def test_a_gqa_group_split_between_cards_is_refused(tmp_path):
    rad = _rad(tmp_path, "llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3)  # card 0: q 0-2, KV 0-1
    with pytest.raises(RadError, match=r"--tp 2: card 0's query heads 0-2 read part of a group of 2 query heads"):
        load_shard(rad, ProcessGroup(0, 2))


@pytest.mark.parametrize("family,quantize", [("qwen3_next", "experts=int4,layers=int4,embeddings=int8"),
                                             ("llama", "layers=fp8"), ("qwen3_moe", "layers=int8")])
def test_a_compact_matrixs_parts_are_its_blocks_and_make_up_its_dequantization(tmp_path, family, quantize):
    """GGUF rows and whole blocks of input columns (the shared expert 64 columns wide: 32 a card, one
    block); fp8_b128 parts that lie inside one scale block (the tiny llama's matrices are 128 x 128 or
    less: a part of 32 or 64 rows or columns)."""
    rad = _rad(tmp_path, family, quantize, **({"shared_expert_intermediate_size": 64} if family == "qwen3_next" else {}))
    m = rad.model
    shares = [card_share(m, r, 2) for r in range(2)]
    compact = [n for n in rad.tensor_names() if isinstance(rad.tensor(n), CompactWeight)]
    assert len(compact) >= 4 * m.num_hidden_layers
    for name in compact:
        whole = rad.tensor(name)
        parts = [shard_tensor(whole, name, m, s) for s in shares]
        if split_kind(name) == "replicated":
            assert all(p is whole for p in parts), name
            continue
        assert all(isinstance(p, CompactWeight) and p.fmt == whole.fmt for p in parts), name
        joined = torch.cat([p.dequantize() for p in parts], dim=1 if name.endswith(ROW_PARALLEL) else 0)
        assert torch.equal(joined, whole.dequantize()), name


def test_fp8_parts_that_start_on_a_scale_block_keep_their_blocks_scales(tmp_path):
    rad = _rad(tmp_path, "llama", "layers=fp8", hidden_size=256, num_attention_heads=2, num_key_value_heads=2,
               head_dim=128, intermediate_size=512)  # card 1: rows 128-255 of q, columns 256-511 of down
    m = rad.model
    for name, dim in (("model.layers.0.self_attn.q_proj.weight", 0), ("model.layers.0.mlp.down_proj.weight", 1)):
        whole = rad.tensor(name)
        parts = [shard_tensor(whole, name, m, card_share(m, r, 2)) for r in range(2)]
        scales = [split_fp8_b128(p.data, p.shape)[1] for p in (whole, *parts)]  # [N / 128, K / 128]
        assert torch.equal(torch.cat(scales[1:], dim=dim), scales[0]), name  # each card: its blocks' scales
        joined = torch.cat([p.dequantize() for p in parts], dim=dim)
        assert torch.equal(joined, whole.dequantize()), name


def test_a_split_that_cuts_a_compact_block_is_refused_by_the_plan_and_the_loader(tmp_path):
    rad = _rad(tmp_path, "llama", "layers=int4", hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    why = (r"--tp 2: card 0's input columns 0-47 of model.layers.0.self_attn.o_proj.weight would cut its q4_0 "
           r"blocks of 32 input columns: give a --tp that splits it on multiples of 32, convert the model with "
           r"its layers dense \(no layers= in --quantize, no --compact\), or serve it with --tp 1")
    with pytest.raises(PlanError, match=why):
        plan_cards((Card.from_mib(256),) * 2, ModelFacts.from_header(rad.header), Config(tp=2))
    with pytest.raises(RadError, match=why):
        load_shard(rad, ProcessGroup(0, 2))
    table = _rad(tmp_path / "t", "llama", "embeddings=fp8")  # card 1's vocab rows 200-399 start inside a block
    with pytest.raises(PlanError, match=r"card 1's rows 200-399 of model.embed_tokens.weight would cut its "
                                        r"fp8_b128 blocks of 128 rows: .* --quantize embeddings=int8"):
        plan_cards((Card.from_mib(256),) * 2, ModelFacts.from_header(table.header), Config(tp=2))
