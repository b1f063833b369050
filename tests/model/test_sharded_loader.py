"""One rank's share of a `.rad` (model/sharded_loader.py): the slices of every rank add up to the
whole tensor, and what the split cannot run yet is refused by name. The forward over 2 processes
is tests/engine/test_tp_workers.py's."""

from __future__ import annotations

import pytest
import torch

from radianced.model.convert import convert
from radianced.model.parallel import ProcessGroup
from radianced.model.rad import RadFile
from radianced.model.rad_format import RadError
from radianced.model.sharded_loader import _COLUMNS, load_shard, owned_experts, shard_tensor
from radianced.model.tiny import FAMILIES, make_tiny
from radianced.sharding import card_share, split_kind


def _rad(tmp_path, family, **overrides) -> RadFile:
    src = make_tiny(family, tmp_path / family, **overrides)
    convert(src, src / "model.rad")
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
            assert torch.equal(torch.cat(parts, dim=1 if name.endswith(_COLUMNS) else 0), whole), name


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
