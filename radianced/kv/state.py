"""Recurrent-state slots and checkpoints of hybrid models, as plain ids.

A hybrid model (Qwen3-Next) keeps, per live sequence, the DeltaNet conv and
recurrent state of every linear-attention layer in one *state slot*
(`RecurrentState` rows on the device). A *checkpoint* is a copy of a state slot
taken at a block boundary; the prefix cache keeps it beside the KV blocks of that
prefix, so a later request restores it instead of recomputing the prefix.

Nothing here touches a tensor: the scheduler hands out ids and emits `StateCopy`
records in the `StepPlan`; the runner executes them (resets and restores before
the forward, saves after it).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Literal


class OutOfSlots(RuntimeError):
    """Every slot of the pool is taken; nothing was allocated."""


class SlotPool:
    """Ids 0..capacity-1; `allocate` hands out the lowest free id (deterministic plans)."""

    def __init__(self, capacity: int, what: str):
        if capacity < 0:
            raise ValueError(f"{what}: capacity {capacity} < 0")
        self.capacity = capacity
        self._what = what
        self._free = list(range(capacity))  # a heap; sorted is a valid heap
        self._taken: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_taken(self) -> int:
        return len(self._taken)

    def allocate(self) -> int:
        """The lowest free id. Raises OutOfSlots when none is free."""
        if not self._free:
            raise OutOfSlots(f"all {self.capacity} {self._what} are taken")
        slot = heapq.heappop(self._free)
        self._taken.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Give `slot` back. Raises ValueError for an id that is not taken (a double free)."""
        if slot not in self._taken:
            raise ValueError(f"{self._what} {slot} is not taken")
        self._taken.remove(slot)
        heapq.heappush(self._free, slot)


class StateSlots(SlotPool):
    """Per-sequence recurrent-state slots: one per live sequence, at most --max-num-seqs."""

    def __init__(self, max_num_seqs: int):
        super().__init__(max_num_seqs, "recurrent-state slots")


class CheckpointSlots(SlotPool):
    """A bounded pool of checkpoint slots (recurrent-state copies kept by the prefix cache)."""

    def __init__(self, capacity: int):
        super().__init__(capacity, "checkpoint slots")


@dataclass(frozen=True, slots=True)
class StateCopy:
    """One recurrent-state operation for the runner.

    reset:   zero state slot `slot` (a sequence that starts from token 0)
    restore: copy checkpoint `checkpoint` into state slot `slot` (a prefix hit)
    save:    copy state slot `slot` into checkpoint `checkpoint` (after the step)
    """

    op: Literal["reset", "restore", "save"]
    slot: int
    checkpoint: int | None = None

    @staticmethod
    def reset(slot: int) -> StateCopy:
        return StateCopy("reset", slot)

    @staticmethod
    def restore(checkpoint: int, slot: int) -> StateCopy:
        return StateCopy("restore", slot, checkpoint)

    @staticmethod
    def save(slot: int, checkpoint: int) -> StateCopy:
        return StateCopy("save", slot, checkpoint)
