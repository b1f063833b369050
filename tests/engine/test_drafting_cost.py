"""Speculative decoding's cost model measured on the serving machine (engine/drafting_cost.py), on real tiny
engines: plain and verify steps alternate, r comes from their pairs, and the engine is left as it was."""

from __future__ import annotations

import pytest

from radianced.engine import drafting_cost
from radianced.engine.speculation import TOKEN_COST, step_cost
from tests.engine.conftest import small_engine
from tests.engine.test_warmup import free_blocks, record_plans


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_one_sequence_alternates_plain_and_verify_steps_and_r_is_adopted(tiny_rads, family):
    rad = tiny_rads[family]
    engine = small_engine(rad, speculative=2)
    allocator, drafting = engine.scheduler.allocator, engine.scheduler.drafting
    free_before = free_blocks(allocator)
    plans = record_plans(engine)
    said = drafting_cost.adopt(engine, rad.model.vocab_size)
    del engine.scheduler.schedule

    decodes = [p for p in plans if p.decodes == len(p.seqs) == 1]
    drafted = [len(p.seqs[0].drafts) for p in decodes]
    assert len(decodes) >= 2 * drafting_cost.ROUNDS and 2 in drafted  # both rounds decoded, with N = 2 drafts
    assert all(a == 0 or b == 0 for a, b in zip(drafted, drafted[1:]))  # never two verify steps in a row
    assert {len(p.seqs) for p in plans} == {1}  # one sequence at a time: the cost model's batch of 1

    policy = engine.scheduler.drafting.policy
    assert policy.token_cost >= 0 and policy.num_drafts == 2 and policy.adaptive  # only r changed
    assert engine.scheduler.drafting.policy.propose is drafting.policy.propose
    assert said is not None and f"r = {policy.token_cost:.3g} " in said
    assert f"a 3-token verify step costs {step_cost(2, 1, policy.token_cost):.2f} plain steps" in said
    assert not engine.scheduler.has_unfinished and engine.scheduler.prefix.num_cached == 0
    assert free_blocks(allocator) == free_before and allocator.num_used == 0


def test_measure_gives_a_positive_plain_step_and_leaves_the_policy_alone(tiny_rads):
    rad = tiny_rads["llama"]
    engine = small_engine(rad, speculative=4)
    before = engine.scheduler.drafting
    plain_s, r = drafting_cost.measure(engine, rad.model.vocab_size)
    assert plain_s > 0 and r >= 0
    assert engine.scheduler.drafting is before and before.policy.token_cost == TOKEN_COST["cpu"]
