"""The routing tally on its own (tiers/routing.py): a step's ids as numpy, counted exactly.

Two routed layers (0 and 1) of four experts, top-2; experts (0, 1) and (1, 3) sit in a slot.
A lookup is one (layer call, distinct expert) a sequence's rows needed, a hit found it in a slot;
routed counts token-to-expert assignments.
"""

from __future__ import annotations

import numpy as np
import torch

from radianced.tiers.routing import RoutingTally, SlabStats, StepRecord, fold

E = 4
SLOTTED = np.array([[False, True, False, False], [False, False, False, True]])  # [R, E]: (0, 1), (1, 3)


def tally() -> RoutingTally:
    return RoutingTally(SlabStats((0, 1)), E)


def record(segments, pos=None, slotted=SLOTTED, rows=1) -> StepRecord:
    return StepRecord((0, 1), pos, slotted, None, rows, list(segments), None, [])


def test_a_one_row_step_counts_its_cells_and_hands_them_to_the_policy():
    t = tally()
    ids = np.array([[[1, 2], [3, 0]]])  # [1, R, k]: layer 0 routes 1 and 2, layer 1 routes 3 and 0
    counts, routed = t.count(record([(0, 1)]), ids)
    assert counts == ((4, 2, 4, 2),)  # (0, 1) and (1, 3) hit
    assert routed.cells.tolist() == [1, 2, 7, 4] and routed.hit.tolist() == [True, False, True, False]
    assert routed.assigned is None and routed.missed is None and routed.pos is None
    assert (t.stats.lookups, t.stats.hits, t.stats.routed) == ({0: 2, 1: 2}, {0: 1, 1: 1}, {0: 2, 1: 2})
    assert t.routing == {(0, 1): 1, (0, 2): 1, (1, 0): 1, (1, 3): 1}


def test_rows_of_two_sequences_count_each_expert_once_per_sequence_and_call():
    """Row 0: sequence A; rows 1-2: sequence B; row 3: a prefill row no sequence counts."""
    t = tally()
    layer0 = [[1, 2], [1, 0], [2, 1], [1, 3]]
    layer1 = [[3, 0], [3, 2], [3, 2], [0, 1]]
    ids = np.stack([np.array(layer0), np.array(layer1)], axis=1)  # [4, R, k]
    counts, routed = t.count(record([(0, 1), (1, 3)], rows=4), ids)
    # A: layer 0 {1 hit, 2 miss}, layer 1 {3 hit, 0 miss}; B: layer 0 {1 hit x2, 0, 2}, layer 1 {3 hit x2, 2 x2}
    assert counts == ((4, 2, 4, 2), (5, 2, 8, 4))
    assert (t.stats.lookups, t.stats.hits, t.stats.routed) == ({0: 4, 1: 4}, {0: 1, 1: 1}, {0: 8, 1: 8})
    assert routed.cells is None and routed.hit is None and routed.pos is None
    assert routed.assigned.tolist() == [[1, 4, 2, 1], [2, 1, 2, 3]]
    assert routed.missed.tolist() == [[True, False, True, True], [True, True, True, False]]
    assert t.routing == {(0, 0): 1, (0, 1): 4, (0, 2): 2, (0, 3): 1, (1, 0): 2, (1, 1): 1, (1, 2): 2, (1, 3): 3}


def test_one_row_segments_in_any_order_count_their_own_rows():
    t = tally()
    ids = np.array([[[1, 2], [3, 0]], [[0, 2], [1, 2]], [[1, 3], [3, 1]]])  # [3, R, k]
    in_order, _ = t.count(record([(0, 1), (1, 2), (2, 3)], rows=3), ids)
    shuffled, _ = t.count(record([(2, 3), (0, 1)], rows=3), ids)
    assert in_order == ((4, 2, 4, 2), (4, 0, 4, 4), (4, 2, 4, 2))
    assert shuffled == ((4, 2, 4, 2), (4, 2, 4, 2))
    assert t.stats.lookups == {0: 8, 1: 8}  # each step's three rows needed all four experts of each layer


def test_a_layer_called_twice_folds_into_that_layer():
    t = tally()
    ids = np.array([[[1, 2], [1, 3]]])  # one row, layer 0 called twice (pos [0, 0])
    slotted = np.array([[False, True, False, False], [False, True, False, False]])
    counts, routed = t.count(record([(0, 1)], pos=np.array([0, 0]), slotted=slotted), ids)
    assert counts == ((4, 2, 4, 2),)  # (0, 1) hits in each call
    assert (t.stats.lookups, t.stats.hits, t.stats.routed) == ({0: 4, 1: 0}, {0: 2, 1: 0}, {0: 4, 1: 0})
    assert routed.pos.tolist() == [0, 0] and routed.assigned.tolist() == [[0, 1, 1, 0], [0, 1, 0, 1]]
    assert t.routing == {(0, 1): 2, (0, 2): 1, (0, 3): 1}


def test_a_step_without_segments_counts_only_the_layers():
    t = tally()
    counts, _ = t.count(record([]), np.array([[[1, 2], [3, 0]]]))
    assert counts == () and t.stats.total_lookups == 4 and t.stats.total_hits == 2


def test_fold_sums_the_calls_of_a_layer():
    per_call = np.array([[1, 2], [3, 4], [5, 6]])  # 3 calls
    assert fold(None, per_call, 2) is per_call
    assert fold(np.array([1, 0, 1]), per_call, 2).tolist() == [[3, 4], [6, 8]]
    assert fold(np.array([1, 0, 1]), per_call.T, 3, axis=1).tolist() == [[3, 6, 0], [4, 8, 0]]


def test_a_record_names_the_rows_routed_to_a_failed_read():
    failed = torch.tensor([False, True, False, True])
    rec = StepRecord((0,), None, None, None, 4, [], failed, ["expert (layer 0, expert 2): read failed"])
    assert rec.failures() == ([1, 3], ["expert (layer 0, expert 2): read failed"])
    assert record([]).failures() == ([], [])


def test_a_cards_tally_counts_only_its_own_experts():
    """--tp: this card owns experts 2-3 of each layer; the rest are another card's to count."""
    t = RoutingTally(SlabStats((0, 1)), E, owned=(2, 4))
    slotted = np.array([[False, False, True, False], [False, False, False, True]])
    one, _ = t.count(record([(0, 1)], slotted=slotted), np.array([[[1, 2], [3, 0]]]))
    assert one == ((2, 2, 2, 0),)  # (0, 2) and (1, 3): both in a slot
    ids = np.stack([np.array([[1, 2], [2, 3], [3, 2]]), np.array([[3, 0], [0, 1], [2, 3]])], axis=1)  # [3, R, k]
    apart, _ = t.count(record([(0, 1), (1, 2)], slotted=slotted, rows=3), ids)
    assert apart == ((2, 2, 2, 0), (2, 1, 2, 1))  # row 1: layer 0 {2 hit, 3 miss}, layer 1 none of its own
    together, routed = t.count(record([(1, 3)], slotted=slotted, rows=3), ids)
    assert together == ((4, 2, 6, 3),)  # rows 1-2: layer 0 {2 hit x2, 3 miss x2}, layer 1 {2 miss, 3 hit}
    assert routed.assigned.tolist() == [[0, 0, 3, 2], [0, 0, 1, 2]]  # the step's three rows, own experts
    assert (t.stats.lookups, t.stats.hits, t.stats.routed) == ({0: 5, 1: 5}, {0: 3, 1: 3}, {0: 11, 1: 7})
    assert t.routing == {(0, 2): 7, (0, 3): 4, (1, 2): 2, (1, 3): 5}


def test_stats_totals_add_up_to_the_counts_of_two_slabs():
    a, b = SlabStats((0, 1)), SlabStats((0, 1))
    a.counts[:] = [[3, 4], [1, 2], [6, 8]]
    b.counts[:] = [[1, 1], [0, 1], [2, 2]]
    b.refills, b.evictions, b.disk_reads, b.disk_bytes = 2, 1, 5, 5 * 4096
    a.add(b.totals())
    assert (a.lookups, a.hits, a.routed) == ({0: 4, 1: 5}, {0: 1, 1: 3}, {0: 8, 1: 10})
    assert (a.refills, a.evictions, a.disk_reads, a.disk_bytes) == (2, 1, 5, 5 * 4096)
    assert b.totals().tolist() == [1, 1, 0, 1, 2, 2, 2, 1, 5, 5 * 4096]
