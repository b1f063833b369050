"""The pieces of a step plan, from the scheduler's sequences: a sequence's chunk while the plan is made
(`Chunk`), and what the runner is told of it (`scheduled`: a `ScheduledSeq`). Reads sequences, changes none.
"""

from __future__ import annotations

from dataclasses import dataclass

from radianced.engine.plan import PENDING, ScheduledSeq
from radianced.engine.request import Sequence
from radianced.kv.state import StateCopy


@dataclass(slots=True)
class Chunk:
    """`n` tokens of a sequence in a step being planned, from its computed ones."""

    seq: Sequence
    n: int
    drafts: tuple[int, ...]  # drafted tokens fed after the chunk's (a decode's last token)
    before: list[StateCopy]  # state resets and checkpoint restores, before the forward
    after: list[StateCopy]  # checkpoint saves, after it


def scheduled(seq: Sequence, n: int, sample_rows: dict[int, int], drafts: tuple[int, ...]) -> ScheduledSeq:
    """What the runner is told of `n` tokens of `seq` from its computed ones, then `drafts`. sample_rows: the
    previous plan's sampled-token rows (where a PENDING input comes from)."""
    start = seq.num_computed_tokens
    sample = start + n == seq.num_tokens
    pending = seq.token_ids[start] == PENDING  # then n == 1: the pending token is the last
    return ScheduledSeq(
        seq_id=seq.seq_id,
        token_ids=tuple(seq.token_ids[start:start + n]) + drafts,
        context_before=start,
        block_table=seq.block_table.frozen(),
        state_slot=seq.state_slot,
        sample=sample,
        prompt_token_ids=seq.request.prompt_token_ids,
        output_token_ids=tuple(seq.token_ids[seq.num_prompt_tokens:]) if sample else (),
        params=seq.params,
        input_from=sample_rows[seq.seq_id] if pending else None,
        drafts=drafts,
        next_token_id=None if sample else seq.token_ids[start + n],
    )
