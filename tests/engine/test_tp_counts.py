"""Rank 0's side of the other cards' expert counts (engine/tp_counts.py), without processes: what it
adds to its slab's stats, to each decoding sequence's counts and to the step's failed sequences.
The all-reduce itself runs in tests/engine/test_tp_tiers.py, over two processes."""

from __future__ import annotations

import numpy as np

from radianced.engine.tp_counts import FAILED_ELSEWHERE, OtherCards
from radianced.tiers.routing import SlabStats


def _others(failed: list[int]) -> OtherCards:
    totals = np.array([4, 6, 2, 3, 8, 12, 1, 1, 2, 8192, 3])  # 2 layers' counts, refills .. disk bytes, slots
    return OtherCards(totals, np.array([[6, 2, 6, 4], [12, 12, 12, 0]]), np.array(failed))


def test_rank_0_adds_the_other_cards_counts_to_its_own():
    stats = SlabStats((0, 1))
    stats.counts[:] = [[6, 6], [6, 0], [12, 12]]
    counts, errors = _others([0, 0, 0]).added(stats, ((6, 4, 6, 2), (6, 1, 6, 5)), None)
    assert counts == ((12, 6, 12, 6), (18, 13, 18, 5))
    assert errors is None
    assert (stats.lookups, stats.hits, stats.routed) == ({0: 10, 1: 12}, {0: 8, 1: 3}, {0: 20, 1: 24})
    assert (stats.refills, stats.evictions, stats.disk_reads, stats.disk_bytes, stats.other_slots) == (1, 1, 2, 8192, 3)
    stats.reset()  # the warm-up's counts go; the other cards' slots stay (not a count)
    assert stats.total_lookups == 0 and stats.other_slots == 3


def test_a_sequence_whose_read_failed_on_another_card_fails_and_rank_0s_own_errors_stay():
    _, errors = _others([0, 1, 0]).added(SlabStats((0, 1)), ((0, 0, 0, 0), (0, 0, 0, 0)), None)
    assert errors == (None, FAILED_ELSEWHERE, None)
    _, errors = _others([1, 0, 0]).added(SlabStats((0, 1)), ((0, 0, 0, 0), (0, 0, 0, 0)), (None, "mine", None))
    assert errors == (FAILED_ELSEWHERE, "mine", None)
