"""What the runner is told of a sequence's chunk (engine/plan_assembly.py `scheduled`): its tokens from the
computed ones, whether it samples, where a PENDING input comes from, and the token after a chunk that does not
sample. It changes nothing of the sequence."""

from __future__ import annotations

from radianced.engine.plan import PENDING
from radianced.engine.plan_assembly import scheduled
from radianced.engine.request import Request, Sequence
from radianced.engine.sampling_params import SamplingParams


def seq(prompt: tuple[int, ...], computed: int = 0, output: tuple[int, ...] = ()) -> Sequence:
    s = Sequence(3, Request("r", prompt, SamplingParams(max_tokens=8), frozenset()))
    s.token_ids += output
    s.num_computed_tokens = computed
    return s


def test_a_prefill_chunk_short_of_the_prompt_does_not_sample_and_names_the_next_token():
    s = seq((5, 6, 7, 8, 9), computed=1)
    got = scheduled(s, 2, {}, ())
    assert (got.token_ids, got.context_before, got.sample, got.next_token_id) == ((6, 7), 1, False, 8)
    assert (got.output_token_ids, got.input_from, got.drafts) == ((), None, ())
    assert s.num_computed_tokens == 1 and s.token_ids == [5, 6, 7, 8, 9]  # unchanged


def test_a_decode_on_a_pending_token_takes_it_from_the_previous_plans_row_and_feeds_its_drafts():
    s = seq((5, 6, 7), computed=4, output=(11, PENDING))
    got = scheduled(s, 1, {3: 2}, (12, 13))
    assert (got.token_ids, got.context_before, got.sample, got.next_token_id) == ((PENDING, 12, 13), 4, True, None)
    assert (got.input_from, got.drafts, got.output_token_ids) == (2, (12, 13), (11, PENDING))
    assert got.prompt_token_ids == (5, 6, 7) and got.seq_id == 3


def test_a_decode_on_a_landed_token_reads_it_from_the_sequence():
    got = scheduled(seq((5, 6, 7), computed=3, output=(11,)), 1, {}, ())
    assert (got.token_ids, got.sample, got.input_from) == ((11,), True, None)
