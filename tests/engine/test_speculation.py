"""Speculative decoding: drafts verified in the batch leave every output as it was without them.

Random tiny weights accept few n-gram drafts, so most tests draft with an oracle that replays a
run without speculation (every draft right), or one that corrupts some drafts (part accepted):
the verify step, the rollback of rejected drafts and the block bookkeeping then run at known
acceptance. The n-gram drafter runs too, on the same workloads.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch

from radianced.card import Card
from radianced.config import Config
from radianced.engine.engine import Engine
from radianced.engine import ngram
from radianced.engine.sampling_params import SamplingParams
from radianced.engine.speculation import (NO_MATCH_PAUSE, PROBE_EVERY, TOKEN_COST, DraftPolicy,
                                          DraftStats, ServedCost, accepted, best_num_drafts, draft_limit,
                                          expected_tokens, mtp_drafts, step_cost, token_cost_from_steps)
from radianced.model.batch import ForwardBatch
from radianced.model.convert import convert
from radianced.model.rad import RadFile
from radianced.model.tiny import make_tiny
from tests.engine.conftest import prompts, request, run_all, small_engine
from tests.engine.test_pipeline import drive, same
from tests.model.test_mtp import mtp_pass

SPEC_FAMILIES = ("llama", "qwen3_moe", "qwen3_next")


class Oracle:
    """Drafts the continuation a run without speculation produced; `wrong_every`: every k-th
    proposal has its second draft replaced (so a step accepts one draft, then is corrected)."""

    def __init__(self, runs: dict[tuple[int, ...], tuple[int, ...]], wrong_every: int = 0, only=None):
        self.runs, self.wrong_every, self.only = runs, wrong_every, only
        self.calls = 0

    def __call__(self, history, n):
        for prompt, out in self.runs.items():
            if tuple(history[:len(prompt)]) == prompt and (self.only is None or prompt in self.only):
                done = len(history) - len(prompt)
                drafts = list(out[done:done + n])
                self.calls += 1
                if self.wrong_every and self.calls % self.wrong_every == 0 and len(drafts) > 1:
                    drafts[1] = (drafts[1] + 1) % 50
                return tuple(drafts)
        return ()


def _spec(rad, n, propose, adaptive=False, **kwargs):
    """An engine built with --speculative n, drafting with `propose` (every time it proposes, unless adaptive)."""
    engine = small_engine(rad, speculative=n, **kwargs)
    engine.scheduler.drafting.policy = DraftPolicy(n, 0.6, adaptive=adaptive,
                                                propose=lambda seq, k: propose(seq.token_ids, k))
    return engine


def _added(engine):
    """The scheduler's Sequence of every request added to `engine` from now on."""
    seqs = []
    add = engine.add
    engine.add = lambda r: seqs.append(add(r)) or seqs[-1]
    return seqs


def _launched(engine):
    plans = []
    launch = engine.runner.launch
    engine.runner.launch = lambda plan: plans.append(plan) or launch(plan)
    return plans


def _workload(rad, **params):
    ps = prompts(rad.model.vocab_size, (5, 17, 30, 9), seed=31)

    def arrivals(e):
        return {0: [request(e, f"r{i}", p, max_tokens=10 + 3 * i, **params) for i, p in enumerate(ps[:2])],
                3: [request(e, f"r{i + 2}", p, max_tokens=12, **params) for i, p in enumerate(ps[2:])]}
    return ps, arrivals


def _runs(ps, result):
    return {tuple(p): result[f"r{i}"][0] for i, p in enumerate(ps)}


# -- the rules -------------------------------------------------------------------


def test_accepted_keeps_the_matching_drafts_and_one_sample_more():
    assert accepted((5, 6, 7), (5, 6)) == (5, 6, 7)  # both accepted, then the bonus sample
    assert accepted((5, 9, 7), (5, 6)) == (5, 9)  # the second draft rejected: its sample replaces it
    assert accepted((4, 6, 7), (5, 6)) == (4,)  # a later match after a rejection counts nothing
    assert accepted((3,), ()) == (3,)


def test_the_cost_model_drafts_more_at_high_acceptance_and_fewer_in_a_big_batch():
    assert expected_tokens(0.0, 4) == 1 and expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert step_cost(0, 8, 0.6) == 1 and step_cost(4, 1, 0.6) == pytest.approx(2.5)
    assert step_cost(4, 1, TOKEN_COST["cpu"]) == pytest.approx(1.47, abs=0.01)  # bench_spec's 5-token step
    assert best_num_drafts(0.9, 4, 1, 0.6) == 4
    assert best_num_drafts(0.3, 4, 1, 0.6) == 0  # 1.3 tokens for 1.375 steps: no
    assert best_num_drafts(0.9, 4, 1, 0.02) == 4 and best_num_drafts(0.9, 4, 64, 0.6) == 0


@pytest.mark.parametrize("c", [1.05, 1.47, 2.39, 4.5])
def test_the_cost_model_measured_from_two_step_times_gives_the_verify_cost_back(c):
    """r from a plain step and a 5-token verify step c times as long (2.39: 2 CPU cores without AMX, where
    r = 0.53), and step_cost with that r is c again."""
    r = token_cost_from_steps(0.010, c * 0.010, 5)
    assert step_cost(4, 1, r) == pytest.approx(c)
    assert token_cost_from_steps(0.0157, 0.0375, 5) == pytest.approx(0.53, abs=0.005)  # 2026-12-04's bench_spec


def test_a_measured_verify_step_no_dearer_than_a_plain_one_is_free_and_one_as_dear_as_its_tokens_never_pays():
    assert token_cost_from_steps(0.010, 0.009, 5) == 0.0 and token_cost_from_steps(0.010, 0.010, 5) == 0.0
    assert token_cost_from_steps(0.010, 0.050, 5) == token_cost_from_steps(0.010, 0.090, 5) == math.inf
    assert step_cost(4, 1, math.inf) == 5 and step_cost(2, 8, math.inf) == 3
    assert best_num_drafts(1.0, 4, 1, math.inf) == 0  # even all accepted: n + 1 tokens for n + 1 steps


class _Plan:
    """A finished step as the served cost reads it: its sequences' drafts, how many decode."""

    def __init__(self, drafts: list[int], decodes: int | None = None):
        self.seqs = [type("S", (), {"drafts": (7,) * n})() for n in drafts]
        self.decodes = len(drafts) if decodes is None else decodes


def test_the_served_cost_moves_r_toward_what_each_verify_step_cost_against_plain_steps_of_its_batch():
    served = ServedCost()
    assert served.observe(_Plan([4]), 0.030, 0.02) is None  # no plain step of one sequence yet: nothing to weigh
    for t in (0.010, 0.010, 0.020):
        assert served.observe(_Plan([0]), t, 0.02) is None
    assert served.plain_s == {1: pytest.approx(0.012)}  # 0.010, then 0.2 of the way to 0.020
    # a 5-token verify step 1.5 plain steps long: r = 0.5 / 3.5 measured; the running r moves a fifth of the way
    # (as logarithms) from 0.02
    r = served.observe(_Plan([4]), 0.018, 0.02)
    assert r == pytest.approx(math.exp(math.log(0.02) + 0.2 * (math.log(0.5 / 3.5) - math.log(0.02))))
    # batch 2, one drafting 3: c = (1 + 5r) / (1 + 2r); 1.4 plain steps give r = 0.4 / 2.2
    served.observe(_Plan([0, 0]), 0.010, r)
    assert served.observe(_Plan([3, 0]), 0.014, 0.4 / 2.2) == pytest.approx(0.4 / 2.2)
    assert served.observe(_Plan([0, 0], decodes=1), 0.5, r) is None and served.plain_s[2] == 0.010  # a prompt chunk


def test_verify_steps_that_cost_their_tokens_plain_steps_drive_r_to_never_paying_and_cheap_ones_back():
    served, r = ServedCost(), 0.02
    served.observe(_Plan([0]), 0.010, r)
    for _ in range(30):
        r = served.observe(_Plan([4]), 0.050, r)  # 5 tokens, 5 plain steps: no draft pays
    assert r > 500 and best_num_drafts(0.9, 4, 1, r) == 0  # (all accepted: 5 tokens for 4.996 steps)
    for _ in range(60):
        r = served.observe(_Plan([1]), 0.0102, r)  # the probes' steps: one draft for 2% more
    assert r < 0.05 and best_num_drafts(0.9, 4, 1, r) == 4


def test_an_adaptive_planner_drafts_by_the_served_r_and_a_forced_or_fixed_one_keeps_its_own(tiny_rads):
    engine = small_engine(tiny_rads["llama"], speculative=2)
    planner = engine.scheduler.drafting
    r0 = planner.policy.token_cost
    planner.observe(_Plan([0]), 0.010)
    planner.observe(_Plan([2]), 0.030)  # 3 plain steps for 3 tokens
    assert planner.policy.token_cost > r0
    forced = dataclasses.replace(planner, policy=dataclasses.replace(planner.policy, adaptive=False))
    forced.observe(_Plan([2]), 0.030)
    assert forced.policy.token_cost == planner.policy.token_cost
    fixed = dataclasses.replace(planner, served=None)  # r as set: drafting that does not follow timing
    fixed.observe(_Plan([2]), 0.030)
    assert fixed.policy.token_cost == planner.policy.token_cost


def test_the_engine_gives_the_planner_each_steps_wall_time_since_the_last_and_none_across_idle(tiny_rads):
    """A real engine serving with drafts: the plain decode steps' wall times reach the planner (an average for
    each batch size run); after it idles, its first step's time since the last is not counted."""
    engine = small_engine(tiny_rads["llama"], speculative=2)
    seen, finished = [], []
    observe, apply = engine.scheduler.drafting.observe, engine.apply
    engine.scheduler.drafting.observe = lambda plan, seconds: seen.append(seconds) or observe(plan, seconds)
    engine.apply = lambda done: finished.append(done.finished is not None) or apply(done)
    ps = prompts(tiny_rads["llama"].model.vocab_size, (9, 20), seed=8)
    run_all(engine, [request(engine, f"r{i}", p, max_tokens=6) for i, p in enumerate(ps)])
    assert engine.plan() is None  # idle
    assert len(seen) == sum(finished) - 1 >= 5  # every step but the first: nothing ended before it
    assert all(t > 0 for t in seen) and engine.scheduler.drafting.served.plain_s
    seen.clear(), finished.clear()
    run_all(engine, [request(engine, "again", ps[0], max_tokens=4, ignore_eos=True)])
    assert len(seen) == sum(finished) - 1 >= 1  # the first step after idling is not seen: its time has the idle


class _Seq:
    """A decoding sequence as the policy reads it."""

    def __init__(self, max_tokens=None):
        self.token_ids, self.draft_stats = [1, 2], DraftStats()
        self.params = SamplingParams(max_tokens=max_tokens)
        self.num_output_tokens, self.num_tokens = 1, 2


def test_a_sequence_below_break_even_stops_drafting_and_probes_again():
    policy = DraftPolicy(4, 0.6, propose=lambda history, n: (1,) * n)
    seq = _Seq()
    stats = seq.draft_stats
    assert policy.drafts(seq, 1, 11, None) == (1,)  # the prior (0.5) buys one draft
    for _ in range(6):
        stats.record(4, 0)
    assert stats.acceptance < 0.2 and not policy.would_draft(seq, 1, 11, None)
    asked = []
    for _ in range(2 * PROBE_EVERY):  # each step: the drafts asked, then the step lands (no draft accepted)
        asked.append(len(policy.drafts(seq, 1, 11, None)))
        stats.record(asked[-1], 0)
    assert asked == ([0] * (PROBE_EVERY - 1) + [1]) * 2
    for _ in range(20):
        stats.record(4, 4)
    assert policy.drafts(seq, 1, 11, None) == (1, 1, 1, 1) and policy.drafts(seq, 1, 3, None) == (1, 1)


def test_drafts_stay_within_max_tokens_the_context_and_the_budget():
    seq = _Seq(max_tokens=4)  # 1 output so far: a step may yield 3 more tokens, so 2 drafts
    assert draft_limit(seq, 100, None) == 2 and draft_limit(seq, 2, None) == 1
    assert draft_limit(seq, 100, 4) == 1  # 2 tokens of a 4-token context: 2 more, 1 of them drafted
    assert DraftPolicy(4, 0.6, adaptive=False, propose=lambda h, n: (7,) * n).drafts(seq, 1, 100, 4) == (7,)


# -- outputs unchanged -----------------------------------------------------------------


@pytest.mark.parametrize("family", SPEC_FAMILIES)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_greedy_outputs_and_logprobs_are_unchanged_by_verified_drafts(tiny_rads, family, n):
    rad = tiny_rads[family]
    ps, arrivals = _workload(rad, logprobs=2)
    base = drive(small_engine(rad), arrivals(small_engine(rad)), False)
    for oracle in (Oracle(_runs(ps, base)), Oracle(_runs(ps, base), wrong_every=2)):
        e = _spec(rad, n, oracle)
        seqs = _added(e)
        assert same(drive(e, arrivals(e), False), base)
        drafted, kept = sum(s.draft_stats.drafted for s in seqs), sum(s.draft_stats.accepted for s in seqs)
        assert kept > 0 and (drafted > kept) == bool(oracle.wrong_every and n > 1)
    e = _spec(rad, n, ngram.propose)  # what ngram_drafts calls
    assert same(drive(e, arrivals(e), False), base)


@pytest.mark.parametrize("family", SPEC_FAMILIES)
def test_all_drafts_right_takes_fewer_steps_and_frees_every_block(tiny_rads, family):
    rad = tiny_rads[family]
    ps, arrivals = _workload(rad)
    base = drive(small_engine(rad), arrivals(small_engine(rad)), False)
    plain = _launched(e0 := small_engine(rad))
    drive(e0, arrivals(e0), False)
    e = _spec(rad, 4, Oracle(_runs(ps, base)))
    plans = _launched(e)
    assert same(drive(e, arrivals(e), False), base)  # drive asserts every block is free at the end
    assert len(plans) <= 0.6 * len(plain)  # the hybrid's drafts stop short of block boundaries (checkpoints)


@pytest.mark.parametrize("family", SPEC_FAMILIES)
def test_a_mixed_batch_where_some_draft_and_pipelined_driving(tiny_rads, family):
    rad = tiny_rads[family]
    ps, arrivals = _workload(rad, logprobs=1)
    base = drive(small_engine(rad), arrivals(small_engine(rad)), False)
    oracle = Oracle(_runs(ps, base), wrong_every=3, only={tuple(ps[0]), tuple(ps[2])})
    e = _spec(rad, 3, oracle)
    plans = _launched(e)
    assert same(drive(e, arrivals(e), True), base)
    mixed = [p for p in plans if any(s.drafts for s in p.seqs) and any(s.sample and not s.drafts for s in p.seqs)]
    assert mixed and any(s.input_from is not None for p in plans for s in p.seqs)  # it also pipelined


@pytest.mark.parametrize("family", SPEC_FAMILIES)
def test_stop_tokens_max_tokens_and_penalties_inside_a_verify_step(tiny_rads, family):
    rad = tiny_rads[family]
    ps = prompts(rad.model.vocab_size, (12, 23, 7), seed=32)
    probe = drive(small_engine(rad), {0: [request(small_engine(rad), f"r{i}", p, max_tokens=16)
                                          for i, p in enumerate(ps)]}, False)
    stop = probe["r0"][0][6]

    def arrivals(e):
        return {0: [request(e, "r0", ps[0], max_tokens=16, stop_token_ids=[stop]),
                    request(e, "r1", ps[1], max_tokens=7, repetition_penalty=1.3, frequency_penalty=0.5),
                    request(e, "r2", ps[2], max_tokens=16, presence_penalty=0.7, logprobs=3)]}
    base = drive(small_engine(rad), arrivals(small_engine(rad)), False)
    assert base["r0"][2] == "stop" and len(base["r1"][0]) == 7
    runs = {tuple(p): probe[f"r{i}"][0] + (1,) * 8 for i, p in enumerate(ps)}  # r0's run drafts past the stop
    runs[tuple(ps[1])] = base["r1"][0] + (1,) * 8  # and r1's past max_tokens
    runs[tuple(ps[2])] = base["r2"][0]
    e = _spec(rad, 4, Oracle(runs))
    plans = _launched(e)
    assert same(drive(e, arrivals(e), False), base)
    r1 = [s for p in plans for s in p.seqs if s.seq_id == 1 and s.sample]
    assert all(len(s.output_token_ids) + len(s.drafts) < 7 for s in r1)  # drafts never cross max_tokens


@pytest.mark.parametrize("family", SPEC_FAMILIES)
def test_prefix_hits_and_preemption_with_drafts(tiny_rads, family):
    rad = tiny_rads[family]
    shared = prompts(rad.model.vocab_size, (40,), seed=33)[0]
    tails = prompts(rad.model.vocab_size, (5, 9, 3, 11), seed=34)
    ps = [shared + t for t in tails]

    def arrivals(e):
        return {0: [request(e, "r0", ps[0], max_tokens=30)],
                4: [request(e, f"r{i}", p, max_tokens=30) for i, p in enumerate(ps[1:], 1)]}
    small = dict(num_blocks=7, max_num_batched_tokens=64)
    base = drive(small_engine(rad, **small), arrivals(small_engine(rad, **small)), False)
    e = _spec(rad, 4, Oracle(_runs(ps, base), wrong_every=2), **small)
    seqs = _added(e)
    assert same(drive(e, arrivals(e), False), base)
    assert any(s.num_preemptions for s in seqs) and any(s.num_reused_tokens for s in seqs)
    assert sum(s.draft_stats.accepted for s in seqs) > 0


@pytest.mark.parametrize("family", SPEC_FAMILIES)
def test_seeded_sampling_gives_the_same_tokens_with_drafts(tiny_rads, family):
    rad = tiny_rads[family]
    ps, arrivals = _workload(rad, temperature=0.8, top_k=20, seed=11)
    base = drive(small_engine(rad), arrivals(small_engine(rad)), False)
    e = _spec(rad, 3, Oracle(_runs(ps, base), wrong_every=2))
    assert same(drive(e, arrivals(e), False), base)


def test_unseeded_sampling_keeps_its_distribution(tiny_rads):
    """Chi-square over the first three tokens' joint outcomes: 300 runs with drafts (an oracle
    that always proposes the same guesses) against 300 without."""
    rad = tiny_rads["llama"]
    prompt = prompts(rad.model.vocab_size, (6,), seed=35)[0]
    params = dict(temperature=1.5, top_k=3, max_tokens=3, ignore_eos=True)
    guess = drive(small_engine(rad), {0: [request(small_engine(rad), "g", prompt, **params)]}, False)["g"][0]

    def outcomes(spec: bool, seed: int) -> Counter:
        sizes = dict(max_num_seqs=30, max_num_batched_tokens=400, seed=seed)
        e = _spec(rad, 2, lambda history, n: guess[len(history) - len(prompt):][:n], **sizes) if spec \
            else small_engine(rad, **sizes)
        reqs = [request(e, f"r{i}", prompt, **params) for i in range(300)]
        return Counter(t for t, _, _ in drive(e, {4 * k: reqs[20 * k:20 * k + 20] for k in range(15)}, False).values())

    a, b = outcomes(False, 1), outcomes(True, 2)
    assert b[guess] > 0
    keys = [k for k in a.keys() | b.keys() if a[k] + b[k] >= 10]
    rest_a, rest_b = 300 - sum(a[k] for k in keys), 300 - sum(b[k] for k in keys)
    cells = [(a[k], b[k]) for k in keys] + ([(rest_a, rest_b)] if rest_a + rest_b else [])
    chi2 = sum((x - y) ** 2 / (x + y) for x, y in cells if x + y)  # two samples of equal size
    dof = len(cells) - 1
    assert chi2 < dof + 3.5 * math.sqrt(2 * dof), (chi2, dof)  # about p < 0.001 for these dof


def test_the_hybrids_state_after_a_partly_accepted_step_is_the_state_without_drafts(tiny_rads):
    rad = tiny_rads["qwen3_next"]
    ps = prompts(rad.model.vocab_size, (9,), seed=36)

    def states_by_length(engine) -> dict[int, tuple]:
        """The sequence's conv and recurrent state after each step, by how many tokens it holds."""
        seqs, out = _added(engine), {}
        engine.add(request(engine, "r0", ps[0], max_tokens=40))
        while engine.scheduler.has_unfinished:
            engine.step()
            seq = seqs[0]
            if seq.state_slot is not None:
                st = engine.runner.cache.states
                out[seq.num_computed_tokens] = (st.conv[:, seq.state_slot].clone(),
                                                st.recurrent[:, seq.state_slot].clone())
        return out

    plain = states_by_length(small_engine(rad))
    base = drive(small_engine(rad), {0: [request(small_engine(rad), "r0", ps[0], max_tokens=40)]}, False)
    oracle = Oracle({tuple(ps[0]): base["r0"][0]}, wrong_every=2)
    drafted = states_by_length(e := _spec(rad, 4, oracle))
    common = sorted(plain.keys() & drafted.keys())
    assert len(common) >= 5 and len(drafted) < len(plain)  # steps of several tokens, compared where both stood
    for n in common:  # equal to fp32 rounding: a verify step's projections are matmuls over 5 rows, not 1
        torch.testing.assert_close(drafted[n], plain[n], atol=2e-5, rtol=1e-5, msg=lambda m: f"at {n} tokens: {m}")
    assert e.runner.cache.states.conv.shape[1] == 8 * 5  # 8 sequences x (1 + 4 drafts) copies


def test_a_sequence_the_drafter_finds_nothing_for_pauses_and_probes_again():
    found = []
    policy = DraftPolicy(4, 0.6, propose=lambda history, n: found[-1][:n] if found else ())
    seq = _Seq()
    for _ in range(NO_MATCH_PAUSE):  # asked, and nothing found
        assert policy.would_draft(seq, 1, 11, None) and policy.drafts(seq, 1, 11, None) == ()
    # paused: the pipeline is not held for it, until the probe is due; steps made ahead count towards it
    for _ in range(PROBE_EVERY - 1):
        assert not policy.would_draft(seq, 1, 11, None)
        seq.draft_stats.record(0, 0)  # a step of it landed, planned ahead without drafts
    assert policy.would_draft(seq, 1, 11, None)
    found.append((5, 6, 7))
    assert policy.drafts(seq, 1, 11, None) == (5,)  # the probe finds something: no longer paused
    assert seq.draft_stats.no_match == 0 and policy.would_draft(seq, 1, 11, None)


# -- the MTP head ---------------------------------------------------------------


@pytest.fixture(scope="module")
def mtp_rad(tmp_path_factory):
    src = make_tiny("qwen3_next", tmp_path_factory.mktemp("mtp"), mtp_layers=1)
    convert(src, src / "model.rad")
    return RadFile.open(src / "model.rad")


def _mtp_draft_logits(rad, ids: list[int]) -> torch.Tensor:
    """The MTP head's logits at every position of `ids` but the last, in one prefill (tests/model/test_mtp.py
    checks this pass against transformers' pieces)."""
    model, _, _, x = mtp_pass(rad, ids[:-1], ids[1:])
    with torch.inference_mode():
        return model.mtp.logits(x)


def _mtp_chain_oracle(rad, history: list[int]) -> tuple[int, int]:
    """The head's two chained drafts after `history` (its last token not yet computed), step by step: the
    main model over history[:-1], the head's rows with the tokens after them, its draft at the last row,
    then one chained step at the last token's position reading the head's normed output and that draft."""
    model, cache, table, x = mtp_pass(rad, history[:-1], history[1:])
    with torch.inference_mode():
        x = x[-1:]
        first = model.mtp.logits(x).argmax(-1)
        step = ForwardBatch.build([[0]], [len(history) - 1], [table], 16)
        x = model.mtp(first, model.mtp.chained(x), model.rotary.at(step.positions), step, cache)
        return int(first), int(model.mtp.logits(x).argmax(-1))


def test_mtp_drafts_leave_greedy_outputs_unchanged_and_are_the_heads_drafts_over_the_whole_text(mtp_rad):
    """Prompts longer than a step's budget: chunks that sample nothing write the head's KV too."""
    ps, arrivals = _workload(mtp_rad, logprobs=1)
    small = dict(max_num_seqs=4, max_num_batched_tokens=16)
    base = drive(small_engine(mtp_rad, **small), arrivals(small_engine(mtp_rad, **small)), False)
    e = small_engine(mtp_rad, speculative=2, **small)
    assert e.runner.model.mtp is not None and e.scheduler.drafting.policy.propose is mtp_drafts
    e.scheduler.drafting.policy = DraftPolicy(2, 0.6, adaptive=False, propose=mtp_drafts)  # draft every step
    seqs, proposals = _added(e), {}
    update = e.scheduler.update

    def recorded(plan, output):
        events = update(plan, output)
        for s in seqs:
            at, drafts = s.draft_stats.proposed
            if drafts:
                proposals.setdefault(s.request_id, {})[at] = drafts
        return events
    e.scheduler.update = recorded
    assert same(drive(e, arrivals(e), False), base)
    assert sum(s.draft_stats.drafted for s in seqs) > 20
    for i, p in enumerate(ps):  # every proposal is the head's draft at that point of the finished text
        text = list(p) + list(base[f"r{i}"][0])
        want = _mtp_draft_logits(mtp_rad, text).argmax(-1).tolist()
        # the first draft is the head's at that point; the second is chained from the head's own output
        assert all(drafts[0] == want[at - 2] and len(drafts) <= 2 for at, drafts in proposals[f"r{i}"].items()), i
    chained = [(i, at, d) for i in range(len(ps)) for at, d in proposals[f"r{i}"].items() if len(d) == 2]
    assert chained
    for i, at, drafts in chained[:6]:  # the chained draft too, recomputed one step at a time
        text = list(ps[i]) + list(base[f"r{i}"][0])
        assert drafts == _mtp_chain_oracle(mtp_rad, text[:at]), (i, at)
    assert sum(map(len, proposals.values())) >= 20  # after prefills, decode steps and verify steps


@pytest.mark.parametrize("speculative", [0, 3])
def test_the_receipt_charges_the_n_plus_one_state_copies_the_engine_allocates(tiny_rads, speculative):
    cfg = Config(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, speculative=speculative,
                 speculative_method="ngram")
    engine = Engine.build(tiny_rads["qwen3_next"], cfg, Card.from_mib(256))
    states = engine.runner.cache.states
    (recurrent,) = [p for p in engine.receipt.state if p.name == "recurrent"]
    assert recurrent.bytes == states.conv.nbytes + states.recurrent.nbytes
    assert states.conv.shape[1] == 4 * (speculative + 1)


@pytest.mark.parametrize("flags", [dict(), dict(expert_slots=8, host_pool_mib=16)], ids=["lending", "tiers"])
def test_the_mtp_head_drafts_beside_the_expert_tiers_in_the_engine_the_daemon_builds(mtp_rad, flags):
    """Engine.build, as the daemon builds it: the MTP layer's experts resident (the receipt's mtp class), the
    decoder layers' in the slab and the host pool; the MTP layer's KV one more layer of the pool."""
    def build(speculative: int) -> Engine:
        return Engine.build(mtp_rad, Config(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                                            speculative=speculative, **flags), Card.from_mib(256))
    ps = prompts(mtp_rad.model.vocab_size, (9, 30), seed=3)
    plain, drafting = build(0), build(2)
    assert drafting.runner.model.mtp is not None and plain.runner.model.mtp is None
    assert [g.layers for g in drafting.receipt.groups] == [g.layers + 1 for g in plain.receipt.groups]
    assert "mtp" in [p.name for p in drafting.receipt.weights]
    assert "mtp" in [p.name for p in plain.receipt.idle_weights]
    assert drafting.scheduler.drafting.policy.propose is mtp_drafts
    drafting.scheduler.drafting.policy = DraftPolicy(2, 0.6, adaptive=False, propose=mtp_drafts)  # draft every step
    seqs = _added(drafting)
    same_tokens = [run_all(e, [request(e, f"r{i}", p, max_tokens=12) for i, p in enumerate(ps)])
                   for e in (plain, drafting)]
    assert same_tokens[0] == same_tokens[1] and sum(s.draft_stats.drafted for s in seqs) > 0


def test_the_heads_kv_is_written_by_a_chunk_that_samples_nothing(mtp_rad):
    """A prompt longer than the step's budget: its first chunk samples nothing, and the head still writes
    its KV for every row of it (the next chunk's rows attend to it), as one pass over the prompt does."""
    m = mtp_rad.model
    prompt = prompts(m.vocab_size, (40,), seed=9)[0]
    e = small_engine(mtp_rad, speculative=2, max_num_seqs=4, max_num_batched_tokens=16)
    seqs = _added(e)
    e.add(request(e, "r0", prompt, max_tokens=2))
    assert e.step() == [] and seqs[0].num_computed_tokens == 16  # the first chunk: nothing sampled
    _, cache, _, _ = mtp_pass(mtp_rad, prompt[:16], prompt[1:17])
    block = seqs[0].block_table.ids()[0]
    for got, want in zip(e.runner.cache.layer(m.num_hidden_layers), cache.layer(m.num_hidden_layers)):
        torch.testing.assert_close(got[block, 0], want[0, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
@pytest.mark.parametrize("kv_dtype", ["fp8", "k6_v4"])
def test_drafts_over_a_quantized_kv_cache_leave_its_outputs_unchanged(tiny_rads, family, kv_dtype):
    """A quantized block's K is stored as the residual from the block's first token: rejected drafts that
    wrote a block's first token are rewritten, in order, before anything reads them. Greedy tokens and
    logprobs with drafts (half of them wrong, crossing block boundaries) equal the same cache's without."""
    rad = tiny_rads[family]

    def build(speculative: int) -> Engine:
        return Engine.build(rad, Config(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                                        kv_cache_dtype=kv_dtype, speculative=speculative), Card.from_mib(256))
    ps, arrivals = _workload(rad, logprobs=1)
    base = drive(build(0), arrivals(build(0)), False)
    e, oracle = build(3), Oracle(_runs(ps, base), wrong_every=2)
    e.scheduler.drafting.policy = DraftPolicy(3, 0.6, adaptive=False, propose=lambda seq, k: oracle(seq.token_ids, k))
    seqs = _added(e)
    got = drive(e, arrivals(e), False)
    assert {r: (t, why) for r, (t, _, why) in got.items()} == {r: (t, why) for r, (t, _, why) in base.items()}
    for r in base:  # a verify step projects 4 rows at once: fp32 rounding that tips a quantized code here and
        # there moves a logprob by up to ~1e-3 (k6_v4); a wrong residual base would move it by far more
        assert [x[0] for x in got[r][1]] == pytest.approx([x[0] for x in base[r][1]], abs=5e-3), r
    assert sum(s.draft_stats.drafted for s in seqs) > sum(s.draft_stats.accepted for s in seqs) > 0
