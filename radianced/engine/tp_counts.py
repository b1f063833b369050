"""The expert counts of the cards of `--tp N` beyond the first, summed to rank 0 after every step.

Each card's slab counts the routing to its own experts (tiers/routing.py: its `owned` range), so
the cards' counts add up to one card's count of the whole model. After each forward every rank
joins one all-reduce of an int64 vector; rank 0 gives zeros, so it receives the others' sum:

    [SlabStats.totals() and the slots in use, less what the card last reported (lookups, hits,
     routed per layer; refills, evictions, disk reads, disk bytes; slots) | (lookups, hits, routed,
     routed_from_misses) per counted segment of the step | per scheduled sequence, the cards whose
     expert read for it failed]

Rank 0 adds the first part to its own slab's stats (its status and metrics then count every card,
and `other_slots` holds the others' slots),
the second to its own per-sequence counts (the per-request line), and fails the sequences the third
names, as one card's disk tier fails them (their requests end with the error; the card that read
logs which expert). One small collective a step (about 3 x layers + 4 x sequences integers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from radianced.tiers.routing import ExpertCounts, SlabStats
from radianced.tiers.slab import ExpertSlab

FAILED_ELSEWHERE = "an expert read from the model file failed on another card of --tp (its log names the expert)"


class CardReport:
    """A card beyond the first: sends what its slab counted since the last `send`, every step."""

    def __init__(self, slab: ExpertSlab):
        self.slab, self._seen = slab, np.zeros(len(slab.stats.totals()) + 1, dtype=np.int64)

    def send(self, counts: Sequence[ExpertCounts], failed: Sequence[bool]) -> None:
        """Join the step's all-reduce with the stats counted since the last call, the step's counts
        per segment and its failed sequences."""
        now = np.append(self.slab.stats.totals(), self.slab.num_slots)
        vector = np.concatenate((now - self._seen, np.asarray(counts, dtype=np.int64).reshape(-1),
                                 np.asarray(failed, dtype=np.int64)))
        self._seen = now
        dist.all_reduce(torch.from_numpy(vector))


@dataclass(frozen=True)
class OtherCards:
    """Rank 0's side: the sum of the other cards' reports for one step."""

    totals: np.ndarray  # as SlabStats.totals(), then the slots in use
    counts: np.ndarray  # [segments, 4]
    failed: np.ndarray  # [sequences]: how many cards failed a read for each

    @classmethod
    def receive(cls, layers: int, segments: int, seqs: int) -> OtherCards:
        """Join the step's all-reduce (`layers` routed layers, the step's counted `segments` and
        scheduled `seqs`) with zeros; the others' sum."""
        n = 3 * layers + 5
        vector = torch.zeros(n + 4 * segments + seqs, dtype=torch.int64)
        dist.all_reduce(vector)
        v = vector.numpy()
        return cls(v[:n], v[n:n + 4 * segments].reshape(segments, 4), v[n + 4 * segments:])

    def added(self, stats: SlabStats, counts: tuple[ExpertCounts, ...],
              errors: tuple[str | None, ...] | None) -> tuple[tuple[ExpertCounts, ...], tuple[str | None, ...] | None]:
        """Add the others' totals to rank 0's `stats`; (rank 0's per-segment `counts` plus theirs,
        rank 0's per-sequence `errors` with the sequences they failed)."""
        stats.add(self.totals[:-1])
        stats.other_slots += int(self.totals[-1])
        counts = tuple(tuple(a + b for a, b in zip(mine, theirs)) for mine, theirs in zip(counts, self.counts.tolist()))
        if self.failed.any():
            errors = tuple((None if errors is None else errors[i]) or (FAILED_ELSEWHERE if f else None)
                           for i, f in enumerate(self.failed.tolist()))
        return counts, errors
