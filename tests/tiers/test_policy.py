"""The slot policy on its own (tiers/policy.py): given these routing counts step by step, exactly
these admissions and victims, in this order.

Two routed layers (0 and 1) of four experts. A step's routing is given as assignments per
(layer, expert); `slotted` says which experts sit in a slot (the slab's table). Pages come from a
scripted lender that records what it was asked.
"""

from __future__ import annotations

import numpy as np
import pytest

from radianced.tiers.policy import ADMIT_MARGIN, ADMIT_MIN, DECAY, Admission, SlotPolicy
from radianced.tiers.routing import Routed

E = 4


class Lender:
    """Lends `pages` in order, then None; `asked` holds each call's `pending`."""

    def __init__(self, *pages: int):
        self.pages, self.asked = list(pages), []

    def __call__(self, pending: int) -> int | None:
        self.asked.append(pending)
        return self.pages.pop(0) if self.pages else None


def slotted(*keys) -> np.ndarray:
    out = np.zeros((2, E), dtype=bool)
    for layer, expert in keys:
        out[layer, expert] = True
    return out


def observe(policy: SlotPolicy, assigned: dict, in_slot=()) -> None:
    """One counted step (every layer called once): `assigned` {(layer, expert): assignments}."""
    per_call = np.zeros((2, E), dtype=np.int64)
    for (layer, expert), n in assigned.items():
        per_call[layer, expert] = n
    policy.observe(Routed(None, None, per_call, (per_call > 0) & ~slotted(*in_slot), None))


def test_the_thresholds_are_the_documented_ones():
    assert (DECAY, ADMIT_MIN, ADMIT_MARGIN) == (0.98, 1.5, 1.5)


def test_a_miss_takes_a_lent_page_once_routed_more_than_admit_min_lately():
    policy, lend = SlotPolicy((0, 1), E), Lender(10, 11)
    observe(policy, {(0, 2): 1})
    assert policy.rebalance(slotted(), lend) == []  # 1 x 0.98 < ADMIT_MIN
    assert lend.asked == []
    observe(policy, {(0, 2): 1})
    assert policy.rebalance(slotted(), lend) == [Admission((0, 2), 10, None)]  # 0.98^2 + 0.98
    assert lend.asked == [0]
    assert policy.score((0, 2)) == pytest.approx(DECAY ** 2 + DECAY)


def test_candidates_go_hottest_first_at_most_max_refills_ties_in_key_order():
    policy, lend = SlotPolicy((0, 1), E), Lender(20, 21, 22, 23)
    observe(policy, {(0, 1): 3, (1, 0): 2, (0, 3): 2, (1, 2): 5})
    assert policy.rebalance(slotted(), lend, max_refills=3) == [
        Admission((1, 2), 20, None), Admission((0, 1), 21, None), Admission((0, 3), 22, None)]
    assert lend.asked == [0, 1, 2]  # pages lent so far, not yet filled
    # (1, 0) was missed but not chosen: a miss is a candidate only until the next rebalance
    assert policy.rebalance(slotted((1, 2), (0, 1), (0, 3)), lend) == []


def test_without_a_page_a_miss_replaces_the_coldest_cached_expert_only_when_clearly_hotter():
    policy, no_pages = SlotPolicy((0, 1), E), Lender()
    for key in ((0, 0), (1, 1)):
        policy.slot_taken(key)
    observe(policy, {(0, 0): 2, (1, 1): 1, (0, 2): 3, (1, 3): 1}, in_slot=((0, 0), (1, 1)))
    # (0, 2): 3 > 1.5 x 1 of (1, 1), the coldest; then (1, 3) at 0.98 is under ADMIT_MIN: stop
    assert policy.rebalance(slotted((0, 0), (1, 1)), no_pages) == [Admission((0, 2), None, (1, 1))]
    assert policy.coldest() == (0, 0)  # the victim left the cache when named
    policy.slot_taken((0, 2))
    observe(policy, {(1, 3): 3}, in_slot=((0, 0), (0, 2)))
    # (1, 3): 1 + 3 / 0.98 = 4.06 against 1.5 x 2 of (0, 0)
    assert policy.rebalance(slotted((0, 0), (0, 2)), no_pages) == [Admission((1, 3), None, (0, 0))]
    policy.slot_taken((1, 3))
    observe(policy, {(1, 1): 2}, in_slot=((0, 2), (1, 3)))
    # (1, 1): 1 + 2 / 0.98^2 = 3.08, not more than 1.5 x 3 of (0, 2), now the coldest: no swap
    assert policy.rebalance(slotted((0, 2), (1, 3)), no_pages) == []
    assert no_pages.asked == [0, 0, 0]


def test_a_rebalance_stops_at_the_first_candidate_that_gets_neither_page_nor_victim():
    policy, lend = SlotPolicy((0, 1), E), Lender(30)
    policy.slot_taken((1, 0))
    observe(policy, {(1, 0): 2, (0, 0): 4, (0, 1): 3, (0, 2): 5}, in_slot=((1, 0),))
    # (0, 2) takes page 30; (0, 0) replaces (1, 0) (4 > 1.5 x 2); (0, 1) finds no victim left
    assert policy.rebalance(slotted((1, 0)), lend) == [Admission((0, 2), 30, None), Admission((0, 0), None, (1, 0))]
    assert lend.asked == [0, 1, 1]  # one page lent so far when (0, 0) and (0, 1) asked


def test_a_slotted_expert_is_no_candidate():
    policy, lend = SlotPolicy((0, 1), E), Lender(40)
    observe(policy, {(0, 1): 2})
    assert policy.rebalance(slotted((0, 1)), lend) == []  # it took a slot since the step
    assert policy.rebalance(slotted(), lend) == []  # and its miss is forgotten
    observe(policy, {(0, 1): 1})
    assert policy.rebalance(slotted(), lend) == [Admission((0, 1), 40, None)]


def test_surrender_victims_go_coldest_first_each_named_once():
    policy = SlotPolicy((0, 1), E)
    for key in ((0, 0), (0, 1), (1, 0)):
        policy.slot_taken(key)
    observe(policy, {(0, 0): 3, (0, 1): 1, (1, 0): 1, (1, 1): 9}, in_slot=((0, 0), (0, 1), (1, 0)))
    assert policy.coldest() == (0, 1)  # ties: the first in (layer, expert) order
    assert policy.victims(2) == [(0, 1), (1, 0)]
    assert policy.victims(5) == [(0, 0)]  # (1, 1) is hot but holds no cache slot (pinned, or none)
    assert policy.victims(1) == [] and policy.coldest() is None


def test_one_row_and_per_call_steps_teach_the_same():
    """A batch-1 decode step comes as its cells; the same routing as per-call arrays."""
    rows, calls = SlotPolicy((0, 1), E), SlotPolicy((0, 1), E)
    for policy in (rows, calls):
        policy.slot_taken((0, 1))
    for _ in range(3):
        cells = np.array([1, 2, 4 + 3, 4 + 0])  # layer 0: 1 and 2, layer 1: 3 and 0
        rows.observe(Routed(cells, np.array([True, False, False, False]), None, None, None))
        observe(calls, {(0, 1): 1, (0, 2): 1, (1, 3): 1, (1, 0): 1}, in_slot=((0, 1),))
        assert rows.rebalance(slotted((0, 1)), Lender()) == calls.rebalance(slotted((0, 1)), Lender())
    assert (rows._raw == calls._raw).all() and (rows._missed == calls._missed).all()


def test_a_layer_called_twice_scores_both_calls():
    policy = SlotPolicy((0, 1), E)
    per_call = np.array([[0, 1, 0, 0], [0, 1, 0, 1]])  # both calls of layer 0
    policy.observe(Routed(None, None, per_call, per_call > 0, np.array([0, 0])))
    assert (policy.score((0, 1)), policy.score((0, 3)), policy.score((1, 1))) == (2.0, 1.0, 0.0)
    assert policy.rebalance(slotted(), Lender(50)) == [Admission((0, 1), 50, None)]


def test_scores_decay_by_decay_a_step_across_renormalizing():
    policy = SlotPolicy((0, 1), E)
    observe(policy, {(0, 0): 1})
    for _ in range(12000):  # the gain passes 1e100 after about 11400 steps and is folded in
        policy.rebalance(slotted(), Lender())
    assert policy._gain < 1e100
    assert policy.score((0, 0)) == pytest.approx(DECAY ** 12000, rel=1e-9)
