"""The scheduler's side of speculative decoding: which decoding sequences draft in a step, and the blocks
their drafts and the MTP head's lookahead take.

The rules (what is accepted, when drafting pays) are engine/speculation.py's; this holds what the
scheduler decides with them:
- A decode drafts only when its blocks can be had without preempting anyone, and never in a plan made
  ahead of a step in flight (a draft needs the pending token); where a sequence the in-flight plan samples
  for would draft, the scheduler drains instead of planning ahead (`holds_pipeline`).
- A hybrid model saves a checkpoint after a plain step ending at a block boundary (the state after
  exactly that many tokens): drafts stop short of the next boundary, so the sequence lands on it.
- The MTP head's chained drafts write their KV `lookahead` positions past a step's own: those blocks are
  taken after every chunk has its own, from free blocks only (never evicting cached ones, never
  preempting), and never in a plan made ahead (its blocks are exactly what `schedule_ahead` counted).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from radianced.engine.plan import StepPlan
from radianced.engine.request import Sequence
from radianced.engine.speculation import DraftPolicy, ServedCost
from radianced.kv.blocks import BlockAllocator


@dataclass
class DraftPlanner:
    """policy: `--speculative`'s; allocator: the scheduler's; checkpoint_block: the block size where a
    hybrid model's prefix cache saves checkpoints (None: no such model); lookahead: MTP's (0: none)."""

    policy: DraftPolicy
    allocator: BlockAllocator
    max_model_len: int | None = None
    checkpoint_block: int | None = None
    lookahead: int = 0
    served: ServedCost | None = field(default_factory=ServedCost)  # None: r stays as the policy has it

    def observe(self, plan: StepPlan, seconds: float) -> None:
        """A finished step took `seconds` of wall time since the previous one ended: an adaptive policy
        drafts by the r the steps served say (speculation.py's `ServedCost`). Without `served` r is fixed,
        and what drafts does not depend on timing (two engines compared draft alike)."""
        if self.served is None or not self.policy.adaptive:
            return
        if (r := self.served.observe(plan, seconds, self.policy.token_cost)) is not None:
            self.policy = dataclasses.replace(self.policy, token_cost=r)

    def drafts(self, seq: Sequence, n: int, budget: int, batch: int) -> tuple[int, ...]:
        """The drafts a chunk of n tokens of `seq` feeds after them in a step of `batch` running sequences
        with `budget` tokens left: a decode's, where its blocks can be had without preempting."""
        if seq.is_prefilling or n != 1 or seq.pending:
            return ()
        drafts = self.policy.drafts(seq, batch, self._budget(seq, budget), self.max_model_len)
        if drafts and not self.allocator.can_append(seq.block_table, seq.num_computed_tokens + n + len(drafts)):
            return ()
        return drafts

    def holds_pipeline(self, in_flight: StepPlan, live: Mapping[int, Sequence], batch: int, budget: int) -> bool:
        """The in-flight plan drafts, or a sequence it samples for that is still `live` (by seq id) would draft
        in the next step."""
        return any(s.drafts for s in in_flight.seqs) or any(
            s.sample and (seq := live.get(s.seq_id)) is not None
            and self.policy.would_draft(seq, batch, self._budget(seq, budget), self.max_model_len)
            for s in in_flight.seqs)

    def take_lookahead(self, chunks: Iterable[tuple[Sequence, int, tuple[int, ...]]]) -> None:
        """Blocks for `lookahead` positions after each (sequence, its chunk's tokens, its drafts) that samples."""
        if not self.lookahead:
            return
        for seq, n, drafts in chunks:
            if seq.num_computed_tokens + n != seq.num_tokens:
                continue  # it does not sample: no chained drafts follow it
            end = seq.num_tokens + len(drafts)
            extra = self.allocator.blocks_for(end + self.lookahead) - len(seq.block_table)
            if extra > 0 and self.allocator.can_allocate(extra, exclude=self.allocator.evictable()):
                self.allocator.append(seq.block_table, end + self.lookahead)

    def _budget(self, seq: Sequence, budget: int) -> int:
        """The budget a decode of `seq` may take with its drafts (short of a checkpoint's boundary)."""
        if self.checkpoint_block is not None:
            return min(budget, -(seq.num_computed_tokens + 1) % self.checkpoint_block)
        return budget
