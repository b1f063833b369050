"""Recurrent-state slots and checkpoint slots: plain ids, lowest first, no double frees."""

from __future__ import annotations

import pytest

from radianced.kv.state import CheckpointSlots, OutOfSlots, StateCopy, StateSlots


def test_state_slots_are_bounded_by_max_num_seqs_and_reused_lowest_first():
    slots = StateSlots(max_num_seqs=3)
    assert [slots.allocate() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(OutOfSlots, match="all 3 recurrent-state slots are taken"):
        slots.allocate()
    slots.free(2)
    slots.free(0)
    assert (slots.num_free, slots.num_taken) == (2, 1)
    assert slots.allocate() == 0
    assert slots.allocate() == 2


def test_freeing_a_slot_twice_is_refused():
    ckpts = CheckpointSlots(2)
    c = ckpts.allocate()
    ckpts.free(c)
    with pytest.raises(ValueError, match="checkpoint slots 0 is not taken"):
        ckpts.free(c)
    with pytest.raises(ValueError):
        ckpts.free(7)


def test_state_copies_are_plain_records():
    assert StateCopy.reset(3) == StateCopy("reset", 3, None)
    assert StateCopy.restore(checkpoint=1, slot=3) == StateCopy("restore", 3, 1)
    assert StateCopy.save(slot=3, checkpoint=1) == StateCopy("save", 3, 1)
