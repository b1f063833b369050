"""One rank's memory under --tp 2 on the CPU: each card's allocation is its receipt's (arena pages,
page size, experts pinned, KV heads), its experts in the arena's pages hold the file's bytes of its
own experts, a card beyond the first follows rank 0's KV pages (giving up cached slots, never
pinned ones), and what this build cannot serve yet is refused by name."""

from __future__ import annotations

import msgspec
import pytest
import torch

from radianced.arena import EXPERTS, KV
from radianced.budget import PlanError
from radianced.config import Config, ConfigError
from radianced.engine.tp_memory import plan_ranks, rank_memory, refuse_device
from radianced.model.parallel import SINGLE, ProcessGroup
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


def test_card_1_follows_rank_0s_kv_pages_giving_up_the_cached_slots_there(tiny_rads):
    memory = rank_memory(tiny_rads["qwen3_moe"], Config(**CFG, expert_slots=4, host_pool_mib=1), ProcessGroup(1, 2))
    arena, slab = memory.arena, memory.experts
    assert (slab.num_slots, slab.placement.count("host"), arena.held(EXPERTS)) == (4, 12, 4)  # slots on pages 0-3
    cached = dict(zip(slab.slotted(), range(4)))  # in no order: which expert sat where is the slab's business
    memory.follow([(True, (2, 3, 9)), (False, (9,)), (True, (4,))])
    assert (arena.held(KV), arena.held(EXPERTS), slab.num_slots) == (3, 2, 2)
    assert [arena.owner(p) for p in (0, 1, 2, 3, 4, 9)] == [EXPERTS, EXPERTS, KV, KV, KV, None]
    assert len(slab.slotted() & cached.keys()) == 2 and slab.stats.evictions == 2
    given = cached.keys() - slab.slotted()
    assert all(slab.table(layer)[e] < 0 for layer, e in given)  # read from the host pool again
    with pytest.raises(ValueError, match=r"pages \[2\] are not free pages of this arena"):
        memory.follow([(True, (2,))])
    memory.close()


def test_pinned_experts_are_never_given_up(tiny_rads):
    memory = rank_memory(tiny_rads["qwen3_moe"], Config(**CFG), ProcessGroup(1, 2))
    assert memory.experts.placement.count("card") == 12
    with pytest.raises(ValueError, match=r"pages \[0\] hold no cached expert slot"):
        memory.follow([(True, (0,))])
    assert memory.arena.owner(0) == EXPERTS and memory.experts.num_slots == 12


def test_a_card_pinning_more_experts_than_card_0_is_refused(tiny_rads):
    """Card 1 holds fewer weights, so its arena has room to pin all 12 of its experts where card 0 pins
    11: on page 11, which card 0's KV may lease."""
    cfg = Config(tp=2, card_mib=33, gpu_headroom_mib=0, max_model_len=256, max_num_seqs=4,
                 max_num_batched_tokens=152, deterministic=True, host_pool_mib=1)
    with pytest.raises(PlanError, match=r"--tp 2: card 1 pins 12 experts, more than card 0's 11, on arena pages card 0 "
                                        r"may give to KV; give each card the room to pin the same \(--expert-slots 11"):
        plan_ranks(tiny_rads["qwen3_moe"], cfg)
    plan_ranks(tiny_rads["qwen3_moe"], msgspec.structs.replace(cfg, expert_slots=11))


def test_a_quantized_kv_cache_is_each_cards_blocks_of_its_kv_heads(tiny_rads):
    one = rank_memory(tiny_rads["qwen3_moe"], Config(**{**CFG, "tp": 1}, kv_cache_dtype="fp8"), SINGLE)
    card = rank_memory(tiny_rads["qwen3_moe"], Config(**CFG, kv_cache_dtype="fp8"), ProcessGroup(1, 2))
    kv1, kv2 = one.receipt.groups[0], card.receipt.groups[0]
    assert 2 * kv2.block_bytes == kv1.block_bytes  # 1 of the 2 KV heads: half the codes and scales
    assert card.kv_storage.dtype == torch.uint8
    assert card.kv_storage.shape == (card.arena.num_pages, card.receipt.blocks_per_page(kv2), kv2.block_bytes)
    one.close()
    card.close()


def test_cuda_is_refused():
    with pytest.raises(ConfigError, match="--tp 2: not yet supported on cuda: NCCL across cards has not run"):
        refuse_device(Config(tp=2), "cuda")
    refuse_device(Config(tp=2), "cpu")
    refuse_device(Config(), "cuda")
