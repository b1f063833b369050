"""The receipt's embedding lines: where the table is charged, and the reason the line gives.

The flag wins; without it the table is charged to host RAM (`ram`, SPEC §2: on the H200 its rows cost a
decode step what they cost from the card), on a GPU card and on the CPU backend alike.
A tied table is the lm_head's one copy on the card whatever the flag, and says so. On a CUDA card the
weights' tensors are also charged what torch's caching allocator holds past their bytes.
"""

from __future__ import annotations

import re

import pytest

from radianced.card import Card, MiB
from radianced.charges import fixed_charges
from radianced.config import Config
from radianced.model.config import ModelConfig
from radianced.receipt import Part
from radianced.sizing import ModelFacts, PagingGroup, allocator_tail

_TINY = dict(vocab_size=400, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=4096, num_hidden_layers=2,
             intermediate_size=128)
UNTIED = ModelFacts.from_config(ModelConfig(family="llama", **_TINY), 2)
TIED = ModelFacts.from_config(ModelConfig(family="llama", tie_word_embeddings=True, **_TINY), 2)
TABLE = 400 * 64 * 2
GROUPS = (PagingGroup("kv_attn", 2, 16, 16 * 128),)


def _charges(facts: ModelFacts, cuda: bool, **flags):
    card = Card.from_mib(1024, cuda=cuda)
    return fixed_charges(card, facts, Config(max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64, **flags),
                         GROUPS, 256)


def _embeddings(parts) -> list[Part]:
    return [p for p in parts if p.name == "embeddings"]


@pytest.mark.parametrize("cuda,flag,where,reason", [
    (True, None, "host", "--embedding-placement ram, the default: the step's rows read over the link"),
    (False, None, "host", "--embedding-placement ram, the default"),
    (True, "ram", "host", "--embedding-placement ram"),
    (True, "vram", "card", "--embedding-placement vram"),
    (False, "vram", "card", "--embedding-placement vram"),
])
def test_an_untied_table_goes_where_the_flag_or_the_default_says_and_the_line_says_why(cuda, flag, where, reason):
    fixed = _charges(UNTIED, cuda, embedding_placement=flag)
    on_card, in_host = _embeddings(fixed.weights), _embeddings(fixed.host_weights)
    assert (on_card, in_host) == (([Part("embeddings", TABLE, reason)], []) if where == "card"
                                  else ([], [Part("embeddings", TABLE, reason)]))


@pytest.mark.parametrize("cuda", [True, False])
@pytest.mark.parametrize("flag,note", [(None, ""), ("vram", ""), ("ram", ", --embedding-placement ram does not "
                                                                          "move a tied table")])
def test_a_tied_table_is_the_lm_heads_one_copy_on_the_card_whatever_the_flag(cuda, flag, note):
    fixed = _charges(TIED, cuda, embedding_placement=flag)
    assert _embeddings(fixed.weights) == _embeddings(fixed.host_weights) == []
    assert [p for p in fixed.weights if p.name == "lm_head"] == [
        Part("lm_head", TABLE, "tied to the embeddings: one copy" + note)]


def test_deterministic_moe_rows_are_charged_twice_on_a_cuda_card_only():
    """--deterministic's MoE sums fp32 rows, one per routed assignment ([T x k, H]): the activations line
    charges them once more on a CUDA card (the allocator splits their freed block between layers); the
    CPU backend and a dense model pay nothing more."""
    moe = ModelFacts.from_config(ModelConfig(family="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                                             moe_intermediate_size=32, **_TINY), 2)

    def activations(facts, cuda, **flags):
        return next(p for p in _charges(facts, cuda, **flags).workspace if p.name == "activations")

    rows = 64 * 2 * 64 * 4  # T x k x H x fp32
    assert activations(moe, True, deterministic=True).bytes == activations(moe, True).bytes + rows
    assert "deterministic MoE's fp32 rows once more" in activations(moe, True, deterministic=True).detail
    assert activations(moe, False, deterministic=True).bytes == activations(moe, False).bytes
    assert activations(UNTIED, True, deterministic=True).bytes == activations(UNTIED, True).bytes


def test_deterministic_moe_rows_are_charged_twice_in_the_graph_pool_too():
    """The step graphs capture the same layer into their own pool, where the allocator splits the rows' freed
    block the same way (the H200's start-up check: 374 MiB reserved against a 364 MiB line without them)."""
    moe = ModelFacts.from_config(ModelConfig(family="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                                             moe_intermediate_size=32, **_TINY), 2)

    def pool(facts, cuda, **flags):
        return next(p for p in _charges(facts, cuda, **flags).workspace if p.name == "graph pool")

    plain, det = pool(moe, True), pool(moe, True, deterministic=True)
    tokens = int(re.search(r"one layer at (\d+) tokens", plain.detail)[1])
    assert det.bytes == plain.bytes + tokens * 2 * 64 * 4  # its tokens x k x H x fp32
    assert "deterministic MoE's fp32 rows once more" in det.detail
    assert pool(moe, False, deterministic=True).bytes == pool(moe, False).bytes == 0
    assert pool(UNTIED, True, deterministic=True).bytes == pool(UNTIED, True).bytes


@pytest.mark.parametrize("nbytes,tail", [
    (1000, 24),  # rounded up to 512 bytes
    (10 * MiB - 100, 100),  # 10 MiB once rounded: a segment of its own, with no rest
    (11 * MiB, MiB),  # a 12 MiB segment, its 1 MiB rest too small to split off
    (10 * MiB + MiB // 2, 0),  # a 1.5 MiB rest is split off and stays free
    (151936 * 2048 * 2, MiB // 2),  # Qwen3-30B's bf16 table (593.5 MiB), held as 594 MiB on the H200
])
def test_the_allocator_tail_follows_torchs_caching_allocator(nbytes, tail):
    assert allocator_tail(nbytes) == tail


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("cuda,placement", [(True, "vram"), (True, "ram"), (False, "vram")])
def test_the_allocator_tails_of_the_weights_on_a_cuda_card_are_charged(cuda, placement, tied):
    """What the allocator holds past a tensor's bytes is charged for the tensors on a CUDA card: the table's
    only where it is on the card (a tied table always is, as the lm_head); nothing on the CPU backend."""
    table = 151936 * 2048 * 2
    model = ModelConfig(family="llama", tie_word_embeddings=tied, **{**_TINY, "vocab_size": 151936, "hidden_size": 2048})
    rows = [("model.embed_tokens.weight", "bf16", (151936, 2048), table), ("model.norm.weight", "bf16", (2048,), 4096)]
    rows += [] if tied else [("lm_head.weight", "bf16", (151936, 2048), table)]
    fixed = _charges(ModelFacts.from_rows(model, rows, ()), cuda, embedding_placement=placement)
    tails = [p.bytes for p in fixed.workspace if p.name == "allocator tails"]
    on_card = (2 if placement == "vram" and not tied else 1) if cuda else 0
    assert tails == ([on_card * MiB // 2] if on_card else [])
