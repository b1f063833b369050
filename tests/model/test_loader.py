"""The loader places exactly what the receipt charges: the contract between model/loader.py and charges.py.

For every flag combination that moves weights (placement mode, embedding placement given or
defaulted, --deterministic, --enforce-eager) and every tiny family (llama ties its lm_head to
the embeddings, the MoE families do not), the tensors `load_plan` puts on the device are, class
by class, the bytes the receipt of a GPU card charges to the card, and the ones it keeps in
host RAM are the receipt's host RAM lines. Then the loader is held to its plan: `load_model`
on the meta device (a stand-in for the GPU: every copy is shape-only) moves exactly the
plan's device bytes, holds the host table in host memory, and leaves no other weight behind.
Every device tensor the loader makes is one `place` call that the model keeps, so moved bytes
equal to the plan's also mean no transient device copy was made (a [q | k | v] joined on the
card would add its parts' bytes).
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from radianced.budget import plan
from radianced.card import Card
from radianced.config import Config
from radianced.model.loader import EMBEDDINGS, _placed, load_model, load_plan
from radianced.sizing import ModelFacts, weight_class
from tests.engine.conftest import FAMILIES, tiny_rads  # noqa: F401 (fixture)

GPU = Card.from_mib(4096, cuda=True)
COMBINATIONS = [dict(placement=p, embedding_placement=e, deterministic=d, enforce_eager=g)
                for p, e, d, g in itertools.product(("auto", "resident", "expert_tiered"), (None, "ram", "vram"),
                                                    (False, True), (False, True))]


def _receipt(rad, flags: dict):
    cfg = Config(max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64, **flags)
    return cfg, plan(GPU, ModelFacts.from_header(rad.header), cfg)


def _by_class(rad, names, tied: bool) -> dict[str, int]:
    """Stored bytes of `names` by weight class; a tied table is the receipt's lm_head line."""
    out: Counter = Counter()
    for n in names:
        c = weight_class(n)
        out["lm_head" if tied and c == "embeddings" else c] += rad.tensor_entry(n).nbytes
    return dict(out)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_plan_puts_on_the_card_what_the_receipt_charges_there(tiny_rads, family):  # noqa: F811
    rad = tiny_rads[family]
    tied = rad.model.tie_word_embeddings
    for flags in COMBINATIONS:
        cfg, receipt = _receipt(rad, flags)
        p = load_plan(rad, cfg.embedding_table, "cuda")
        assert _by_class(rad, p.device, tied) == {part.name: part.bytes for part in receipt.weights}, flags
        assert sum(rad.tensor_entry(n).nbytes for n in p.device) == receipt.weights_bytes
        host = {part.name: part.bytes for part in receipt.host_weights if part.name == "embeddings"}
        assert {"embeddings": rad.tensor_entry(n).nbytes for n in p.host} == host, flags
        assert not set(p.device) & set(p.host)


def test_the_table_goes_where_the_flag_says_and_a_tied_one_stays_with_the_lm_head(tiny_rads):  # noqa: F811
    assert tiny_rads["llama"].model.tie_word_embeddings and not tiny_rads["qwen3_moe"].model.tie_word_embeddings
    assert load_plan(tiny_rads["qwen3_moe"], "ram", "cuda").host == (EMBEDDINGS,)
    assert EMBEDDINGS in load_plan(tiny_rads["qwen3_moe"], "vram", "cuda").device
    assert load_plan(tiny_rads["llama"], "ram", "cuda").host == ()  # one copy, on the card
    assert EMBEDDINGS in load_plan(tiny_rads["llama"], "ram", "cuda").device
    assert load_plan(tiny_rads["qwen3_moe"], "ram", "cpu").host == ()  # host RAM is the CPU backend's card


def _tensors_by_device(model) -> dict[str, int]:
    """Bytes of the distinct tensors the model's blocks hold, by device type (experts are the source's)."""
    seen: dict[int, torch.Tensor] = {}

    def note(t: torch.Tensor) -> torch.Tensor:
        seen[id(t)] = t
        return t

    _placed(model, note)
    out: Counter = Counter()
    for t in seen.values():
        out[t.device.type] += t.nbytes
    return dict(out)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("embedding_placement", ["ram", "vram"])
def test_load_model_follows_its_plan_and_leaves_nothing_behind(tiny_rads, family, embedding_placement):  # noqa: F811
    rad = tiny_rads[family]
    p = load_plan(rad, embedding_placement, "meta")
    device_bytes = sum(rad.tensor_entry(n).nbytes for n in p.device)
    host_bytes = sum(rad.tensor_entry(n).nbytes for n in p.host)
    model = load_model(rad, "meta", embedding_placement=embedding_placement)
    assert (model.placed.device_bytes, model.placed.host_bytes) == (device_bytes, host_bytes)
    assert _tensors_by_device(model) == {"meta": device_bytes, **({"cpu": host_bytes} if host_bytes else {})}
    if p.host:  # the table is a copy of its own (pinned where CUDA is), holding the file's values
        assert model.embed.weight.device.type == "cpu"
        assert torch.equal(model.embed.weight, rad.tensor(EMBEDDINGS))
    if rad.model.tie_word_embeddings:
        assert model.lm_head.weight is model.embed.weight


def test_on_the_cpu_nothing_moves_and_the_placement_changes_nothing(tiny_rads):  # noqa: F811
    rad = tiny_rads["qwen3_moe"]
    model = load_model(rad, "cpu", embedding_placement="ram")
    assert (model.placed.device_bytes, model.placed.host_bytes) == (0, 0)
    assert _tensors_by_device(model).keys() == {"cpu"}
    assert model.embed.weight.data_ptr() == rad.tensor(EMBEDDINGS).data_ptr()  # the file's view, no copy
