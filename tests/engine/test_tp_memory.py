"""One rank's memory under --tp 2 on the CPU: each card's allocation is its receipt's (arena pages,
page size, experts pinned, KV heads), its experts in the arena's pages hold the file's bytes of its
own experts, and what this build cannot serve yet is refused by name."""

from __future__ import annotations

import pytest
import torch

from radianced.arena import EXPERTS
from radianced.budget import PlanError
from radianced.config import Config, ConfigError
from radianced.engine.tp_memory import plan_ranks, rank_memory, refuse_device
from radianced.model.parallel import ProcessGroup
from radianced.model.sharded_loader import owned_experts

CFG = dict(tp=2, card_mib=256, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_card_is_allocated_as_its_receipt_says(tiny_rads, rank):
    rad = tiny_rads["qwen3_moe"]
    memory = rank_memory(rad, Config(**CFG), ProcessGroup(rank, 2))
    r, share = memory.receipt, memory.cards.shares[rank]
    assert r is memory.cards.receipts[rank]
    assert (memory.arena.num_pages, memory.arena.page_bytes) == (r.arena_pages, r.page_bytes)
    assert memory.arena.held(EXPERTS) == r.experts_pinned == 3 * 4  # 3 layers x experts 0-3 or 4-7
    kv = r.groups[0]
    assert memory.kv_storage.shape == (r.arena_pages, r.blocks_per_page(kv), 3, 2, 16, 1, 16)  # 1 KV head a card
    assert memory.kv_storage.untyped_storage().data_ptr() == memory.arena.storage.untyped_storage().data_ptr()
    plain = owned_experts(rad, share)
    for layer in range(3):
        ids = torch.arange(share.experts[0], share.experts[1])
        assert torch.equal(memory.experts.slab[memory.experts.table(layer)[ids]], plain.slab[plain.table(layer)[ids]])


def test_a_dense_card_has_no_experts_and_its_kv_heads(tiny_rads):
    memory = rank_memory(tiny_rads["llama"], Config(**CFG), ProcessGroup(1, 2))
    assert memory.experts is None and memory.arena.held(EXPERTS) == 0
    assert memory.kv_storage.shape[-2] == tiny_rads["llama"].model.num_key_value_heads // 2


def test_experts_left_off_the_cards_are_refused(tiny_rads):
    with pytest.raises(PlanError, match=r"--tp 2: card 0's receipt leaves \d+ experts in the host pool and 0 on "
                                        r"disk; the expert tiers per card are not built yet"):
        plan_ranks(tiny_rads["qwen3_moe"], Config(**CFG, expert_slots=4, host_pool_mib=16))


def test_a_quantized_kv_cache_and_cuda_are_refused(tiny_rads):
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp8 with --tp 2: not yet supported; use auto, or --tp 1"):
        plan_ranks(tiny_rads["qwen3_moe"], Config(**CFG, kv_cache_dtype="fp8"))
    with pytest.raises(ConfigError, match="--tp 2: not yet supported on cuda: NCCL across cards has not run"):
        refuse_device(Config(tp=2), "cuda")
    refuse_device(Config(tp=2), "cpu")
    refuse_device(Config(), "cuda")
