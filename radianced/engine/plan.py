"""The seam between planning and execution: `StepPlan` in, `StepOutput` back.

Plain frozen data, no torch. The runner turns a plan into device tensors
(`ForwardBatch.build(token_ids, context_before, block_table[g], ...)` per
paging group g), runs `before` state copies, the forward and sampling, then
`after` copies, and returns one `StepOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radianced.kv.state import StateCopy

__all__ = ["PENDING", "ScheduledSeq", "StateCopy", "StepPlan", "StepOutput"]

PENDING = -1  # a token id not known yet: what a step in flight samples (never a real id)


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One sequence's share of a step.

    token_ids: the new tokens, at positions context_before .. context_before+len-1.
    block_table: the sequence's table in each paging group, covering every position
        up to the chunk's end (KV of the new tokens is written there).
    state_slot: recurrent-state slot (hybrid models), else None.
    sample: this chunk ends at the sequence's last token: sample one from its logits.
    prompt_token_ids: the request's prompt (the request's own tuple, not a copy).
    output_token_ids: where it samples, the output so far (the next token is output
        number len(output_token_ids): penalties, per-request seeds); else ().
    params: the request's sampling params (opaque here).
    input_from: None, or the plan was made while the previous plan was in flight and this is
        a decode of the token that plan samples for the sequence: token_ids is (PENDING,), the
        runner takes the id on the device from row `input_from` of the previous plan's sampled
        tokens (its sampling sequences in plan order), and output_token_ids ends with PENDING.
    drafts: speculative decoding's drafted tokens, the tail of token_ids after the decode's last
        token (engine/speculation.py). The step samples at all len(drafts)+1 positions, position j
        with output_token_ids + drafts[:j] as its history, and yields the tokens `accepted` keeps.
    next_token_id: where the chunk does not sample, the token after it (what the MTP head reads at its
        last row); None where it samples.
    """

    seq_id: int
    token_ids: tuple[int, ...]
    context_before: int
    block_table: tuple[tuple[int, ...], ...]
    state_slot: int | None
    sample: bool
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()
    params: Any = None
    input_from: int | None = None
    drafts: tuple[int, ...] = ()
    next_token_id: int | None = None


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one step computes.

    before: state resets and checkpoint restores, run before the forward.
    after: checkpoint saves, run after the forward (state slots then hold the
        state after each sequence's chunk).
    preempted_seq_ids: sequences preempted (recompute) while planning this step.
    finished_seq_ids: sequences finished or cancelled since the previous plan with
        work in it; the runner drops whatever it keeps per sequence.
    """

    seqs: tuple[ScheduledSeq, ...] = ()
    before: tuple[StateCopy, ...] = ()
    after: tuple[StateCopy, ...] = ()
    preempted_seq_ids: tuple[int, ...] = ()
    finished_seq_ids: tuple[int, ...] = ()

    @property
    def decodes(self) -> int:
        """The sequences that decode in this step (past their prompt); the others prefill."""
        return sum(s.context_before >= len(s.prompt_token_ids) for s in self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What a step produced, aligned with `plan.seqs`.

    token_ids[i]: the tokens plan.seqs[i]'s step yields: () where it does not sample, one where it
        samples, 1 to len(drafts)+1 where it drafted (the accepted drafts, then one sampled token).
    logprobs[i]: the sampler's logprobs payloads (opaque here), one per token of token_ids[i], or None.
    expert_counts[i]: (lookups, hits, routed, routed_from_misses) of plan.seqs[i]'s routed
        experts in this step where it is a decode step (one token after the first sampled);
        None for other sequences. The whole field is None without an expert slab.
    drafts[i]: the MTP head's drafts for plan.seqs[i]'s next step, from the position its last yielded
        token follows; () where it does not sample. The whole field is None without an MTP head.
    errors[i]: why plan.seqs[i]'s results are void (an expert it routed to could not be read
        from disk), or None; the whole field is None when nothing failed. Such a sequence's
        sampled token and the KV of this step's tokens must not be used.
    seconds: the step's own time on its device (engine/step_timer.py), or None where not known when
        it was collected (a CUDA step that sampled nothing).
    """

    token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[Any, ...] | None = None
    expert_counts: tuple[tuple[int, int, int, int] | None, ...] | None = None
    errors: tuple[str | None, ...] | None = None
    drafts: tuple[tuple[int, ...], ...] | None = None
    seconds: float | None = None
