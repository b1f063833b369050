"""The arena's pages: leases, lending between KV and experts, views. Exact page ids."""

from __future__ import annotations

import math

import pytest
import torch

from radianced.arena import EXPERTS, KV, Arena, FixedPolicy, Lease, LendingPolicy, OutOfPages, policy_for
from radianced.budget import plan
from radianced.card import Card
from radianced.config import Config
from radianced.model.config import ModelConfig
from radianced.sizing import ModelFacts

PAGE = 4096


class Tenant:
    """A tenant that gives up its oldest pages first, except those marked live."""

    def __init__(self, arena: Arena, name: str, cost: float = 1.0):
        self.arena, self.name, self.cost = arena, name, cost
        self.pages: list[int] = []  # oldest (coldest) first
        self.live: set[int] = set()
        arena.register(name, self)

    def take(self, n: int) -> tuple[int, ...]:
        lease = self.arena.lease(self.name, n)
        self.pages += lease.pages
        return lease.pages

    def give_back(self, pages) -> None:
        for p in pages:
            self.pages.remove(p)
        self.arena.release(Lease(self.name, tuple(pages)))

    def reclaim_cost(self) -> float:
        return self.cost if self._spare() else math.inf

    def surrender(self, n: int) -> Lease:
        give = self._spare()[:n]
        for p in give:
            self.pages.remove(p)
        return Lease(self.name, tuple(give))

    def _spare(self) -> list[int]:
        return [p for p in self.pages if p not in self.live]


def lending(pages=10, floor=3, buffer=2):
    arena = Arena(pages, PAGE, policy=LendingPolicy(expert_floor=floor, kv_buffer=buffer))
    kv, slab = Tenant(arena, KV, cost=5.0), Tenant(arena, EXPERTS, cost=1.0)
    return arena, kv, slab


def test_leases_hand_out_the_lowest_free_pages_and_release_checks_the_owner():
    arena = Arena(4, PAGE)
    a = arena.lease(KV, 2)
    assert a == Lease(KV, (0, 1)) and arena.held(KV) == 2 and arena.num_free == 2
    with pytest.raises(ValueError, match="page 0 is not held by experts"):
        arena.release(Lease(EXPERTS, (0,)))
    arena.release(Lease(KV, (1,)))  # any subset of what the tenant holds
    assert arena.lease(EXPERTS, 2).pages == (1, 2)
    with pytest.raises(ValueError, match="page 1 is not held by kv"):
        arena.release(Lease(KV, (0, 1)))  # nothing changes on a bad release
    assert arena.held(KV) == 1
    with pytest.raises(OutOfPages, match="kv: asked for 2 pages, 1 usable now"):
        arena.lease(KV, 2)


def test_experts_leave_the_kv_buffer_free_and_never_take_live_kv():
    arena, kv, slab = lending()
    assert slab.take(8) == tuple(range(8))
    with pytest.raises(OutOfPages):
        slab.take(1)  # the last two free pages are KV's buffer
    assert kv.take(2) == (8, 9)
    kv.live = {8, 9}
    with pytest.raises(OutOfPages):
        slab.take(1)  # KV's pages are live: its reclaimer gives none
    assert arena.stats().moved == ()


def test_kv_takes_expert_pages_back_down_to_the_floor_and_gives_them_back():
    """Raise KV demand, then lower it: pages move experts -> KV -> experts, exactly."""
    arena, kv, slab = lending()
    slab.take(8)  # 0..7
    kv.take(2)  # 8, 9
    kv.live = set(kv.pages)
    assert kv.take(3) == (0, 1, 2)  # the slab's three coldest slots
    kv.live |= {0, 1, 2}
    with pytest.raises(OutOfPages):
        kv.take(3)  # only 3, 4 are above the floor of 3 slots
    assert slab.pages == [5, 6, 7] and arena.num_free == 2
    assert arena.stats().moved == (((EXPERTS, KV), 5),)
    assert kv.take(2) == (3, 4)  # the two pages freed by the failed lease stay usable
    kv.live = set()
    kv.give_back(list(kv.pages))  # demand drops: every KV page is free again
    assert slab.take(5) == (0, 1, 2, 3, 4)  # experts fill up to the buffer again
    assert (arena.held(EXPERTS), arena.held(KV), arena.num_free) == (8, 0, 2)


def test_experts_take_back_kv_pages_no_live_request_uses():
    arena, kv, slab = lending(buffer=0)
    kv.take(6)  # 0..5
    kv.live = {0, 1, 2, 3}
    slab.take(4)  # 6..9
    assert slab.take(2) == (4, 5)  # KV's cached pages
    assert arena.stats().moved == (((KV, EXPERTS), 2),)


def test_one_eviction_order_cheapest_to_get_back_first():
    arena, kv, slab = lending(pages=8, floor=2, buffer=0)
    slab.take(4)  # 0..3, cost 1.0 each
    kv.take(4)  # 4..7, cost 5.0 each (cached, not live)
    kv.live = {6, 7}
    # KV's own cached pages cost more than expert slots (KV weighs them against `cheapest_other`):
    # its leases take expert slots, cheapest first, down to the floor
    assert arena.cheapest_other(KV) == 1.0 < kv.cost
    assert kv.take(2) == (0, 1)
    assert slab.pages == [2, 3] and arena.cheapest_other(KV) == math.inf  # the floor: none left to take
    assert dict(arena.stats().moved) == {(EXPERTS, KV): 2}
    assert arena.cheapest_other(EXPERTS) == 5.0  # KV's cached pages, for the slab's leases
    assert slab.take(1) == (4,) and kv.pages == [5, 6, 7, 0, 1]


def test_a_lease_never_takes_the_asking_tenants_own_pages():
    """Only the tenant can count what recycling its own pages gains (a KV page's free blocks are
    already in its pool's count), so the arena leaves that to it."""
    arena, kv, slab = lending(pages=8, floor=2, buffer=0)
    slab.take(4)
    kv.take(4)  # 4..7, cached
    kv.take(2)  # the slots above the floor
    with pytest.raises(OutOfPages, match="kv: asked for 1 pages, 0 usable"):
        kv.take(1)
    assert kv.pages == [4, 5, 6, 7, 0, 1] and slab.pages == [2, 3]


def test_cached_kv_goes_first_when_it_is_cheaper_than_an_expert():
    arena, kv, slab = lending(pages=8, floor=0, buffer=0)
    slab.cost, kv.cost = 9.0, 0.5
    slab.take(4)
    kv.take(4)
    kv.live = {6, 7}
    assert arena.cheapest_other(EXPERTS) == 0.5  # the slab's leases take KV's cached pages first
    assert slab.take(2) == (4, 5) and kv.pages == [6, 7]
    assert arena.cheapest_other(KV) == 9.0  # a KV tenant weighs its own recycling against this
    assert arena.cheapest_other(EXPERTS) == math.inf  # KV has nothing to give


def test_pages_given_back_or_taken_back_are_leased_again_at_once():
    """No fence: a page is free when `release` or a tenant's `surrender` returns (stream order
    keeps a queued step's reads ahead of the next tenant's writes)."""
    arena, kv, slab = lending(pages=4, floor=0, buffer=0)
    assert slab.take(4) == (0, 1, 2, 3)
    assert kv.take(2) == (0, 1)  # surrendered by the slab and leased in the same call
    assert arena.num_free == 0 and arena.stats().moved == (((EXPERTS, KV), 2),)
    slab.give_back([3])
    assert arena.num_free == 1 and kv.take(1) == (3,)


def test_deterministic_quotas_forbid_lending():
    arena = Arena(10, PAGE, policy=FixedPolicy(((EXPERTS, 6), (KV, 4))))
    kv, slab = Tenant(arena, KV), Tenant(arena, EXPERTS)
    slab.take(6)
    with pytest.raises(OutOfPages, match="past its quota of 6"):
        slab.take(1)
    kv.take(4)
    with pytest.raises(OutOfPages, match="past its quota of 4"):
        kv.take(1)
    kv.give_back([6, 7])
    assert kv.take(2) == (6, 7) and arena.stats().moved == ()


def test_views_interpret_pages_in_place():
    arena = Arena(4, PAGE)
    pages = arena.paged_view(torch.bfloat16, (2, 3, 16))  # [P, 2, 3, 16]: 192 B of each 4 KiB page
    assert pages.shape == (4, 2, 3, 16) and pages.data_ptr() == arena.storage.data_ptr()
    one = arena.page_view(2, torch.float32, (4,))
    one.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert torch.equal(arena.storage[2 * PAGE:2 * PAGE + 16].view(torch.float32), one)
    pages[3, 1, 2, 15] = 7.0
    assert arena.page_view(3, torch.bfloat16, (2, 3, 16))[1, 2, 15] == 7.0
    with pytest.raises(ValueError, match="needs 8192 bytes; a page holds 4096"):
        arena.page_view(0, torch.float32, (2048,))


def test_the_arena_of_a_receipt_is_its_elastic_line_within_one_page():
    m = ModelConfig(family="qwen3_moe", vocab_size=400, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                    max_position_embeddings=4096, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    r = plan(Card(48 << 20, 48 << 20), ModelFacts.from_config(m, 4),
             Config(gpu_headroom_mib=0, max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64, host_pool_mib=1))
    arena = Arena.from_receipt(r)
    assert arena.storage.numel() == r.arena_pages * r.page_bytes
    assert 0 <= r.elastic - arena.storage.numel() < r.page_bytes
    assert arena.policy == policy_for(r) == LendingPolicy(expert_floor=6, kv_buffer=3)
    assert arena.lease(EXPERTS, r.expert_slots).pages == tuple(range(r.expert_slots))
    assert arena.num_free == r.kv_start_pages


def test_a_recorded_tenants_changes_come_out_once_in_order_and_another_arena_takes_those_pages():
    """--tp: rank 0's arena records its KV tenant; a card beyond the first takes the same pages."""
    rank0, card1 = Arena(6, PAGE), Arena(8, PAGE)
    rank0.record(KV)
    rank0.lease(EXPERTS, 1)  # not recorded: another tenant
    a = rank0.lease(KV, 2)
    rank0.release(Lease(KV, (a.pages[0],)))
    rank0.lease(KV, 1)
    changes = rank0.changes(KV)
    assert changes == [(True, (1, 2)), (False, (1,)), (True, (1,))] and rank0.changes(KV) == []
    card1.lease(EXPERTS, 1)
    for leased, pages in changes:
        card1.take(KV, pages) if leased else card1.release(Lease(KV, pages))
    assert [card1.owner(p) for p in range(4)] == [EXPERTS, KV, KV, None] and card1.held(KV) == 2
    assert card1.lease(EXPERTS, 2).pages == (3, 4)  # the free pages skip the taken ones
    with pytest.raises(ValueError, match=r"kv: pages \[0, 9\] are not free pages of this arena, each once"):
        card1.take(KV, (0, 9, 5))
    with pytest.raises(ValueError, match=r"kv: pages \(5, 5\) are not free pages of this arena, each once"):
        card1.take(KV, (5, 5))
    assert card1.held(KV) == 2 and card1.owner(5) is None  # nothing changed
