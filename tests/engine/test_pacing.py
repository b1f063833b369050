"""The step pacer (engine/pacing.py) and the driver with it: a long prefill runs in steps of
about --max-step-seconds, so a cancel or a newcomer waits one such step (issue 19, finding 4:
a cancelled 6,000-token prompt held the next request 15.8 s on a 2-core CPU); while sequences
decode, a step that also prefills takes at most --itl-factor decode steps' time (issue 18)."""

from __future__ import annotations

import asyncio

import pytest

from radianced.config import Config
from radianced.engine.driver import AsyncEngine
from radianced.engine.pacing import BESIDE_DECODES, StepPacer
from radianced.engine.sampling_params import SamplingParams
from radianced.sizing import BLOCK_TOKENS
from tests.engine.conftest import prompts, small_engine
from tests.engine.test_pipeline import Trace


def test_the_budget_is_what_the_measured_rate_does_in_the_target_time():
    pacer = StepPacer(2048, 0.5, 24)
    assert pacer.budget == 2048
    assert pacer.observe(2048, 1, 15.0) == 68  # SmolLM2's 2,048 tokens in 15 s on the 2-core CPU
    assert pacer.observe(68, 1, 0.5) == 68
    assert pacer.observe(68, 1, 0.25) == 136  # twice as fast: twice the tokens
    assert pacer.observe(136, 1, 0.01) == 272  # far faster: at most twice a step
    assert pacer.observe(272, 1, 0.001) == 544
    assert pacer.observe(1500, 1, 0.001) == 2048  # never past the flag


def test_the_rate_is_the_largest_steps_not_a_later_small_ones():
    """A small step's time is mostly fixed cost: its rate through zero says far fewer tokens fit than do. The
    H200's warm-up: a 2,048-token step in 12 ms, then the HTTP warm-up's prompts of 3-17 tokens in 4 ms each,
    whose rate (375 tokens in 0.5 s) had chunked the first user prompt of 551 tokens into 3 steps."""
    pacer = StepPacer(2048, 0.5, 24)
    assert pacer.observe(2048, 1, 0.012) == 2048
    assert pacer.observe(3, 1, 0.004) == 2048
    assert pacer.observe(17, 1, 0.004) == 2048
    assert pacer.observe(2048, 1, 0.013) == 2048  # as large: its rate replaces the last


def test_a_full_step_at_the_cap_or_one_over_the_target_measures_the_rate_again():
    pacer = StepPacer(2048, 0.5, 24)
    assert pacer.observe(65, 1, 0.1) == 325  # a CPU's warm-up prompt: 650 tokens a second
    assert pacer.observe(8, 1, 0.03) == 325  # a smaller step: the rate stays (its own says 133 fit)
    assert pacer.observe(325, 1, 0.4) == 406  # a full step at the cap measures it again
    assert pacer.observe(100, 1, 1.0) == 50  # over the target, however small: its rate
    assert pacer.observe(30, 1, 0.05) == 50  # under the cap: the rate stays
    assert pacer.observe(50, 1, 0.06) == 100  # a full step at the cap: 416 fit, at most twice the cap


def test_decode_steps_leave_the_budget_alone_and_the_floor_holds():
    pacer = StepPacer(512, 0.5, 24)
    assert pacer.observe(8, 8, 3.0) == 512  # a decode step's time is fixed cost, not a rate
    assert pacer.observe(100, 4, 100.0) == 24  # 0.5 tokens in the target: the floor
    assert StepPacer(512, 0.0, 24).observe(512, 1, 60.0) == 512  # 0: no pacing
    assert StepPacer(16, 0.5, 24).floor == 16  # the floor never exceeds the flag


def step_seconds(fixed: float, per_token: float):
    return lambda prefill: fixed + per_token * prefill


def run_mixed_steps(pacer: StepPacer, decoding: int, seconds, steps: int) -> list[int]:
    """Steps of `decoding` decodes and the prefill the pacer allows, timed by `seconds(prefill)`."""
    sizes = []
    for _ in range(steps):
        prefill = pacer.next_budget(decoding) - decoding
        sizes.append(prefill)
        pacer.observe(decoding + 1 + prefill, decoding + 1, seconds(prefill), decoding, decoding)
    return sizes


def test_beside_decodes_a_prefill_takes_what_fits_in_the_itl_factor_of_a_decode_step():
    pacer = StepPacer(2048, 0.5, 20, itl_factor=3.0)
    assert pacer.observe(4, 4, 0.002, decoding=4) == 20  # a decode step: the baseline; a block beside it (floored)
    # prefill steps cost 3 ms + 20 us a token; 3 decode steps are 6 ms: 150 tokens fit
    sizes = run_mixed_steps(pacer, 4, step_seconds(0.003, 20e-6), 8)
    assert sizes[:4] == [16, 32, 64, 128] and sizes[4:] == [149] * 4  # doubling, then the line's 149.99
    assert pacer.step_line() == pytest.approx((0.003, 20e-6))
    assert pacer.next_budget(0) == 2048  # nobody decodes: the step-time cap alone


def test_where_the_fixed_cost_alone_passes_the_target_a_step_is_half_prefill_at_least():
    """An eager step of the H200's 8-layer model: 7 ms + 2.5 us a token, beside 2 ms decode steps
    (2.5x: 5 ms): no chunk keeps the target, so the chunk makes the fixed cost's worth (2,800 tokens,
    the flag's 2,048)."""
    pacer = StepPacer(2048, 0.5, 24, itl_factor=2.5)
    pacer.observe(4, 4, 0.002, decoding=4)
    assert run_mixed_steps(pacer, 4, step_seconds(0.007, 2.5e-6), 9)[-2:] == [2044, 2044]


def test_a_fixed_cost_over_half_the_target_still_leaves_the_chunk_that_meets_it():
    """3 ms + 12 us a token beside 2.1 ms decodes (2.5x: 5.25 ms): 187 tokens keep the step at the target,
    though the fixed cost's worth (250) is more."""
    pacer = StepPacer(2048, 0.5, 24, itl_factor=2.5)
    pacer.observe(4, 4, 0.0021, decoding=4)
    assert run_mixed_steps(pacer, 4, step_seconds(0.003, 12e-6), 12)[-1] == 187


def test_prefill_steps_without_decodes_leave_the_line_alone():
    """A 2,048-token prefill alone costs 14 ms on the H200's 8-layer model (its fixed part looks like 12 ms),
    while a chunk beside 1.5 ms decodes costs 2 ms + 4 us a token: only the latter says what fits in
    2.5 x 1.5 ms (437 tokens)."""
    pacer = StepPacer(2048, 0.5, 24, itl_factor=2.5)
    for n in (2048, 1500, 2048, 900):
        pacer.observe(n + 1, 1, 0.012 + 1e-6 * n)
    assert pacer.step_line() is None
    pacer.observe(4, 4, 0.0015, decoding=4)
    assert run_mixed_steps(pacer, 4, step_seconds(0.002, 4e-6), 12)[-1] == 437


def test_the_line_forgets_old_steps():
    pacer = StepPacer(4096, 0.5, 20, itl_factor=3.0)
    pacer.observe(4, 4, 0.002, decoding=4)
    run_mixed_steps(pacer, 4, step_seconds(0.001, 10e-6), 10)  # (6 - 1) ms / 10 us: 500 tokens
    assert pacer.next_budget(4) == 4 + 499  # 499.99..., rounded down
    sizes = run_mixed_steps(pacer, 4, step_seconds(0.001, 40e-6), 25)  # 4x dearer: toward 125
    assert sizes[-1] == 125  # steps of one size say nothing of the slope: the old steps' weight still tells it


def test_without_an_itl_factor_or_a_decode_step_seen_the_budget_is_the_step_time_cap():
    assert StepPacer(2048, 0.5, 20).observe(4, 4, 0.002, decoding=4) == 2048
    pacer = StepPacer(2048, 0.5, 4, itl_factor=2.0)
    assert pacer.observe(1000, 1, 0.5, decoding=1) == 1000  # no decode step measured yet
    assert pacer.observe(2, 2, 0.01, decoding=2) == 2 + 16  # now one: a block beside the decodes
    assert pacer.step_line() is None  # one prefill step: no line yet


def test_beside_decodes_a_step_stays_within_the_largest_mixed_graph():
    """The line says 149 tokens fit (as above), but the engine's largest mixed graph holds 64 rows: 4 decodes
    and 60 tokens of prefill, so the step replays a graph; with nobody decoding, the whole budget."""
    pacer = StepPacer(2048, 0.5, 20, itl_factor=3.0, graph_tokens=64)
    pacer.observe(4, 4, 0.002, decoding=4)
    assert run_mixed_steps(pacer, 4, step_seconds(0.003, 20e-6), 8)[-1] == 60
    assert pacer.next_budget(0) == 2048
    assert StepPacer(2048, 0.5, 20, graph_tokens=64).next_budget(4) == 2048  # no --itl-factor: no cap


def test_beside_decodes_a_replayed_step_takes_at_most_256_tokens_whatever_the_largest_graph():
    """The H200's 8-layer MoE (bench/README, session 17): decodes 1.5 ms, a step that prefills beside them
    ~3.7 ms fixed (it reads nearly every expert) + 3.7 us a token, --itl-factor 2.5: the fixed part passes
    the target, so the half-prefill rule asks ~1,000 tokens; graphs up to 2,048 tokens would take them
    (8.9 ms steps); the cap keeps 252 beside 4 decodes. With nobody decoding, the whole budget."""
    pacer = StepPacer(2048, 0.5, 20, itl_factor=2.5, graph_tokens=2048)
    pacer.observe(4, 4, 0.0015, decoding=4)
    sizes = run_mixed_steps(pacer, 4, step_seconds(0.0037, 3.7e-6), 12)
    assert sizes[-1] == BESIDE_DECODES - 4 == 252
    assert StepPacer(2048, 0.5, 20, itl_factor=2.5).next_budget(4) == 2048  # before any decode step: no cap
    assert pacer.next_budget(0) == 2048


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(max_step_seconds=-1.0), dict(floor=0),
                                 dict(itl_factor=1.0), dict(itl_factor=-2.0), dict(graph_tokens=-1)])
def test_bad_pacer_arguments_are_refused(bad):
    with pytest.raises(ValueError):
        StepPacer(**{"max_tokens": 64, "max_step_seconds": 0.5, "floor": 8, "itl_factor": 2.5, **bad})


def test_the_daemons_pacer_floor_is_a_decode_for_every_sequence_and_a_block():
    cfg = Config(max_num_seqs=4, max_num_batched_tokens=2048, max_step_seconds=0.25, itl_factor=4.0)
    pacer = StepPacer.for_config(cfg)
    assert (pacer.max_tokens, pacer.max_step_seconds, pacer.floor, pacer.itl_factor) == \
        (2048, 0.25, 4 + BLOCK_TOKENS, 4.0)


async def test_a_long_prefill_is_cut_into_paced_steps_so_a_cancel_waits_one_short_step(tiny_rads):
    """A target no step can meet drives the budget to the floor after the first step: the rest of
    the prompt goes in floor-sized steps (from the third: the second was planned while the first
    ran), the tokens are the unpaced run's, and a cancel in the
    middle frees every block."""
    rad = tiny_rads["llama"]
    prompt = prompts(rad.model.vocab_size, (400,), seed=31)[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    floor = 20
    tokens = {}
    for paced in (False, True):
        engine = small_engine(rad, max_num_batched_tokens=96)
        trace = Trace(engine)
        ae = AsyncEngine(engine, pacer=StepPacer(96, 1e-9, floor) if paced else None)
        task = asyncio.create_task(ae.run())
        tokens[paced] = [t async for c in ae.generate(prompt, params) for t in c.token_ids]
        sizes = [p.num_tokens for p in trace.plans]
        if paced:
            assert sizes[:2] == [96, 96] and all(n <= floor for n in sizes[2:]) and len(sizes) > 12, sizes
            stream = ae.submit(prompts(rad.model.vocab_size, (400,), seed=32)[0], params)
            while len(trace.plans) < len(sizes) + 3:  # three paced prefill steps in
                await asyncio.sleep(0.001)
            stream.close()  # the client went away
            await ae.between_steps(lambda: None)  # the cancel is taken before the next plan
            assert engine.scheduler.allocator.num_used == 0 and not engine.scheduler.has_unfinished
        else:
            assert sizes[:5] == [96, 96, 96, 96, 16]
        task.cancel()
    assert tokens[True] == tokens[False] and len(tokens[True]) == 6


async def test_the_driver_tells_the_pacer_how_many_sequences_decode_next(tiny_rads):
    """A stream decodes while a 300-token prompt prefills: each finished step reports the running
    sequences that decode next (1 while the newcomer prefills, 2 once its last chunk ran) and those that
    decoded in it, and the budget it returns is the plan's."""
    rad = tiny_rads["llama"]
    seen = []

    class Recording(StepPacer):
        def observe(self, tokens, sequences, seconds, decoding=0, decodes=0):
            seen.append((tokens, sequences, decoding, decodes))
            return 40

    engine = small_engine(rad, max_num_batched_tokens=96)
    trace = Trace(engine)
    ae = AsyncEngine(engine, pacer=Recording(96, 0.5, 20, itl_factor=2.5))
    task = asyncio.create_task(ae.run())
    long_run = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = ae.submit(prompts(rad.model.vocab_size, (8,), seed=41)[0], long_run)
    while len(trace.plans) < 3:
        await asyncio.sleep(0.001)
    second = ae.submit(prompts(rad.model.vocab_size, (300,), seed=42)[0], SamplingParams(max_tokens=1))
    [c async for c in second]
    first.close()
    task.cancel()
    mixed = [d for t, s, d, _ in seen if s == 2 and t > 2]
    assert len(mixed) > 3 and set(mixed[:-2]) == {1} and 2 in mixed, str(seen)  # after its last chunk: both
    assert {n for t, s, _, n in seen if s == 2 and t > 2} == {1}  # the finished steps: one decoded beside the prefill
    assert max(p.num_tokens for p in trace.plans[4:]) <= 40  # the pacer's budget, from the second paced step
