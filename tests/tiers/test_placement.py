"""Placement: the home of every routed expert, exactly, from the receipt's counts and a ranking."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radianced.budget import plan
from radianced.card import Card
from radianced.config import parse_config
from radianced.model.rad import RadFile
from radianced.sizing import ModelFacts
from radianced.tiers.placement import CARD, DISK, HOST, place, place_receipt, rank_order, routed_experts
from radianced.tiers.profile import Profile, model_checksum

# 2 layers x 4 experts, in file order
EXPERTS = [(layer, e) for layer in (0, 1) for e in range(4)]
RANKING = [(1, 2), (0, 3), (1, 0), (0, 0), (1, 3), (0, 1), (1, 1), (0, 2)]


def test_homes_follow_the_ranking_pinned_host_then_disk():
    p = place(EXPERTS, pinned=2, host=3, disk=3, slots=4, ranking=RANKING)
    assert p.pinned == ((1, 2), (0, 3))  # the two hottest, slot order = rank order
    assert p.host == ((0, 0), (1, 0), (1, 3))  # ranks 3-5, rows in file order
    assert p.disk == ((0, 1), (0, 2), (1, 1))  # the coldest three, file order
    assert p.prefill == ((1, 0), (0, 0))  # cache slots 2-3: the next two by rank
    assert p.slots == ((1, 2), (0, 3), (1, 0), (0, 0))
    assert [p.home(*k) for k in EXPERTS] == [HOST, DISK, DISK, CARD, HOST, DISK, CARD, HOST]
    assert [p.host_row(*k) for k in p.host] == [0, 1, 2]
    assert (p.count(CARD), p.count(HOST), p.count(DISK), p.experts) == (2, 3, 3, 8)
    with pytest.raises(KeyError):
        p.host_row(1, 2)  # on the card, not in the pool
    assert p.line() == "placement: 2 experts pinned on card, 3 in host pool, 3 on disk; 2 cache slots pre-filled"


def test_without_a_ranking_the_file_order_ranks():
    p = place(EXPERTS, pinned=3, host=5, disk=0, slots=3)
    assert p.pinned == ((0, 0), (0, 1), (0, 2))
    assert p.host == ((0, 3), (1, 0), (1, 1), (1, 2), (1, 3))
    assert p.disk == () and p.prefill == ()


def test_a_partial_ranking_is_followed_by_the_rest_in_file_order():
    assert rank_order(EXPERTS, [(1, 3), (0, 2)]) == [(1, 3), (0, 2), (0, 0), (0, 1), (0, 3), (1, 0), (1, 1), (1, 2)]
    p = place(EXPERTS, pinned=0, host=2, disk=6, slots=3, ranking=[(1, 3), (0, 2)])
    assert p.host == ((0, 2), (1, 3)) and p.prefill == ((1, 3), (0, 2), (0, 0))


def test_more_slots_than_experts_prefill_every_expert_once():
    p = place(EXPERTS, pinned=1, host=7, disk=0, slots=100, ranking=RANKING)
    assert p.slots == tuple(RANKING)


def test_deterministic_split_has_no_cache_slots_to_prefill():
    p = place(EXPERTS, pinned=4, host=0, disk=4, slots=4, ranking=RANKING)
    assert p.prefill == () and p.slots == tuple(RANKING[:4])


@pytest.mark.parametrize("kw, ranking, message", [
    (dict(pinned=2, host=2, disk=2, slots=2), None, "= 6, but the model has 8 routed experts"),
    (dict(pinned=3, host=5, disk=0, slots=2), None, "2 slots cannot hold the 3 pinned experts"),
    (dict(pinned=-1, host=9, disk=0, slots=0), None, "pinned = -1: a count cannot be negative"),
    (dict(pinned=0, host=8, disk=0, slots=0), [(0, 1), (0, 1)], "names expert (layer 0, expert 1) twice"),
    (dict(pinned=0, host=8, disk=0, slots=0), [(5, 0)], "(layer 5, expert 0), which the model does not have"),
])
def test_inconsistent_inputs_are_refused(kw, ranking, message):
    with pytest.raises(ValueError) as e:
        place(EXPERTS, ranking=ranking, **kw)
    assert message in str(e.value)


def test_an_expert_listed_twice_is_refused():
    with pytest.raises(ValueError, match=r"expert \(layer 0, expert 0\) is listed twice"):
        place([(0, 0), (0, 0)], pinned=2, host=0, disk=0, slots=2)


@dataclass(frozen=True)
class Counts:  # the Receipt fields placement reads
    experts_pinned: int
    experts_host: int
    experts_disk: int
    expert_slots: int


def test_place_receipt_reads_the_receipt_fields():
    p = place_receipt(Counts(2, 3, 3, 4), EXPERTS, RANKING)
    assert p == place(EXPERTS, pinned=2, host=3, disk=3, slots=4, ranking=RANKING)


@pytest.mark.parametrize("flags, homes", [
    (["--deterministic", "--expert-slots", "10", "--weights-disk-tier"], (10, 0, 38)),
    (["--deterministic", "--expert-slots", "10", "--host-pool-mib", "1"], (10, 38, 0)),
    (["--expert-slots", "20", "--host-pool-mib", "1"], (0, 48, 0)),
])
def test_placement_of_a_real_plan_puts_the_profile_top_on_the_card(tier_rad, flags, homes):
    """The receipt of budget.plan for the tiny model, and a profile's ranking: the top-ranked
    pairs are pinned (or pre-filled), file order elsewhere."""
    with RadFile.open(tier_rad) as rad:
        experts = routed_experts(rad.header)
        assert experts == [(layer, e) for layer in range(3) for e in range(16)]
        cfg = parse_config(["--max-model-len", "256", "--max-num-seqs", "1", "--max-num-batched-tokens", "16",
                            "--gpu-headroom-mib", "0", *flags])
        receipt = plan(Card.from_mib(48), ModelFacts.from_header(rad.header), cfg)
        profile = Profile(model_checksum(tier_rad), rad.model.moe_layers, 16)
        for layer in range(3):
            profile.add(layer, [(layer * 16 + e) * 7 % 48 for e in range(16)])  # distinct, shuffled counts
        ranking = profile.rank()
    p = place_receipt(receipt, experts, ranking)
    assert (p.count(CARD), p.count(HOST), p.count(DISK)) == homes
    assert len(p.slots) == min(receipt.expert_slots, 48)
    assert list(p.slots) == ranking[:len(p.slots)]  # exactly the top-ranked pairs fill the slots
    assert list(p.host) == sorted(p.host) and list(p.disk) == sorted(p.disk)


@settings(deadline=None, max_examples=60)
@given(st.data())
def test_any_split_partitions_the_experts(data):
    n_layers = data.draw(st.integers(1, 3))
    n_experts = data.draw(st.integers(1, 6))
    experts = [(layer, e) for layer in range(n_layers) for e in range(n_experts)]
    total = len(experts)
    pinned = data.draw(st.integers(0, total))
    host = data.draw(st.integers(0, total - pinned))
    slots = data.draw(st.integers(pinned, total + 2))
    ranking = data.draw(st.permutations(experts))[:data.draw(st.integers(0, total))]
    p = place(experts, pinned=pinned, host=host, disk=total - pinned - host, slots=slots, ranking=ranking)
    order = rank_order(experts, ranking)
    assert sorted(p.pinned + p.host + p.disk) == experts
    assert list(p.pinned) == order[:pinned]
    assert set(p.host) == set(order[pinned:pinned + host])
    assert list(p.slots) == order[:min(slots, total)]
    assert [p.host_row(*k) for k in p.host] == list(range(host))
