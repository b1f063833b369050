"""Which experts hold the slab's cache slots: admission and eviction by decayed routing frequency.

Frequency with exponential decay over steps (`DECAY` per step), with admission
control. Pure LRU thrashes when a step routes more distinct experts than there
are slots; profile-static never adapts to the traffic. Decayed counts keep the
experts that keep being routed, but admitting every miss (as a first version
did) churned: on the H200 at 25% coverage under a Zipf router it refilled 8
slots every step, each refill a copy as dear as the miss it saves, and decoded
slower than at 10% coverage. So a missed expert takes a slot only when it was
routed more than once lately (`ADMIT_MIN`) and is clearly hotter than the
slot's coldest expert (`ADMIT_MARGIN`), and the half-life is a few dozen
steps, not a few. Decay is lazy (a growing gain scales new counts) and the
per-expert state is dense numpy ([layer position, expert]), so learning a step
and choosing victims are a few vectorized calls, not Python per expert.

`SlotPolicy` holds no slots and moves no bytes: it learns each counted step's
routing (`observe`), and returns decisions that the slab applies: the refills
of a rebalance (`Admission`: read this expert into this lent page, or in place
of this victim) and the victims of a surrender (`victims`). A victim leaves the
policy's cache when it is named (or when the slab reports its slot lost,
`slot_lost`); an expert joins it when the slab reports its slot filled
(`slot_taken`). Pinned experts never join: they are never evicted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from radianced.tiers.routing import Key, Routed, fold

DECAY = 0.98  # per step: a count halves in about 34 steps
ADMIT_MIN = 1.5  # decayed routings a missed expert needs before it may take a slot
ADMIT_MARGIN = 1.5  # ... and how much hotter than the slot's coldest expert, which it replaces
MAX_REFILLS = 8  # slots refilled per rebalance: bounds the copy work between steps


@dataclass(frozen=True, slots=True)
class Admission:
    """One refill a rebalance chose: expert `key` takes a slot."""

    key: Key  # the missed expert that takes a slot
    page: int | None  # the page the arena lent for it; None: the victim's page, refilled in place
    victim: Key | None  # the cached expert it replaces (to evict first); None: a lent page


class SlotPolicy:
    """Decayed routing counts of every (layer, expert) and the set of cached (evictable) slots."""

    def __init__(self, layers: Sequence[int], num_experts: int):
        self.layers, self.num_experts = tuple(layers), num_experts
        self._layer_pos = {layer: i for i, layer in enumerate(self.layers)}
        shape = (len(self.layers), num_experts)
        # score = raw / gain: the gain grows 1/DECAY a step instead of every count shrinking
        self._raw = np.zeros(shape)
        self._gain = 1.0
        self._missed = np.zeros(shape, dtype=bool)  # routed without a slot since the last rebalance
        self._cached = np.zeros(shape, dtype=bool)  # in a cache slot (pinned ones never are)

    def observe(self, routed: Routed) -> None:
        """Learn a counted step's routing: its assignments raise the scores, its misses become the
        next rebalance's candidates."""
        if routed.cells is not None:  # one row: each cell routed once
            self._raw.ravel()[routed.cells] += self._gain
            self._missed.ravel()[routed.cells[~routed.hit]] = True
            return
        L = len(self.layers)
        self._raw += fold(routed.pos, routed.assigned * self._gain, L)
        self._missed |= fold(routed.pos, routed.missed, L)

    def slot_taken(self, key: Key) -> None:
        """`key` now holds a cache slot: a victim the policy may name from now on."""
        self._cached[self._cell(key)] = True

    def slot_lost(self, key: Key) -> None:
        """`key` left its cache slot by another's choice (the slab gave that page up): no victim now."""
        self._cached[self._cell(key)] = False

    def score(self, key: Key) -> float:
        """The decayed routing count of `key` now."""
        return float(self._raw[self._cell(key)]) / self._gain

    def coldest(self) -> Key | None:
        """The cached expert with the lowest score (ties: the first in (layer, expert) order), or None."""
        if not self._cached.any():
            return None
        cell = int(np.where(self._cached, self._raw, np.inf).argmin())
        return self.layers[cell // self.num_experts], cell % self.num_experts

    def victims(self, n: int) -> list[Key]:
        """Up to n cached experts to evict, coldest first; they leave the cache now."""
        out = []
        while len(out) < n and (cold := self.coldest()) is not None:
            self._cached[self._cell(cold)] = False
            out.append(cold)
        return out

    def rebalance(self, slotted: np.ndarray, lease: Callable[[int], int | None],
                  max_refills: int = MAX_REFILLS) -> list[Admission]:
        """Decay the scores a step, then choose refills among the experts missed since the last
        rebalance and still without a slot (`slotted`: [layer position, expert] bool), hottest
        first, at most `max_refills`, each routed at least `ADMIT_MIN` lately: into a page from
        `lease(pending)` (a page, or None: none to lend; `pending`: pages lent so far and not yet
        filled), else in place of the coldest cached expert if `ADMIT_MARGIN` times hotter. Stops
        at the first candidate that qualifies for neither. Victims leave the cache now."""
        self._gain /= DECAY
        if self._gain > 1e100:
            self._renormalize()
        candidates = np.flatnonzero(self._missed & ~slotted)
        self._missed[:] = False
        candidates = candidates[np.argsort(-self._raw.flat[candidates], kind="stable")][:max_refills]
        E = self.num_experts
        admissions: list[Admission] = []
        lent = 0
        for cell in candidates.tolist():
            if self._raw.flat[cell] / self._gain < ADMIT_MIN:
                break
            key = (self.layers[cell // E], cell % E)
            page = lease(lent)
            if page is not None:
                lent += 1
                admissions.append(Admission(key, page, None))
                continue
            cold = self.coldest()
            if cold is None or ADMIT_MARGIN * self._raw[self._cell(cold)] >= self._raw.flat[cell]:
                break
            self._cached[self._cell(cold)] = False
            admissions.append(Admission(key, None, cold))
        return admissions

    def _cell(self, key: Key) -> tuple[int, int]:
        """The (layer position, expert) index of the dense state."""
        return self._layer_pos[key[0]], key[1]

    def _renormalize(self) -> None:
        """Fold the gain into the raw counts (before it overflows)."""
        self._raw /= self._gain
        self._gain = 1.0
