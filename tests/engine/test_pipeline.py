"""Pipelined stepping (`Engine.step(ahead=True)`, the daemon's round: step N+1 planned and
launched before step N is collected) gives exactly the sequential engine's tokens and logprobs, whatever ends a request;
its fallbacks (preemption, checkpoint hand-over) drain and stay exact; penalties pipeline,
counting the pending token on the device, and stay exact; the prefix
cache only ever holds confirmed blocks; the expert slab's counts are the sequential ones.

Every comparison also asserts that plans were made ahead (`input_from`) or drained, so no test
passes by never pipelining.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from radianced.card import Card
from radianced.config import Config
from radianced.engine.driver import AsyncEngine
from radianced.engine.engine import Engine
from radianced.engine.graphs import StepGraphs
from radianced.engine.plan import PENDING
from radianced.engine.sampling_params import SamplingParams
from radianced.sizing import BLOCK_TOKENS
from tests.engine.conftest import FAMILIES, prompts, request, small_engine


class Trace:
    """The plans an engine's runner launched: how many were made ahead of a step in flight."""

    def __init__(self, engine: Engine):
        self.plans = []
        launch = engine.runner.launch

        def traced(plan):
            self.plans.append(plan)
            return launch(plan)

        engine.runner.launch = traced

    @property
    def ahead(self) -> int:
        return sum(any(s.input_from is not None for s in p.seqs) for p in self.plans)


def drive(engine: Engine, arrivals: dict[int, list], pipelined: bool, cancel_at: dict[int, str] | None = None):
    """Step until every request ends; arrivals[k]: requests added before step k, cancel_at[k]: a
    request cancelled before step k. Returns {request id: (tokens, logprobs, finish reason)}."""
    cancel_at = cancel_at or {}
    out: dict[str, list] = defaultdict(lambda: [[], [], None])
    k = 0
    while k <= max(arrivals) or engine.scheduler.has_unfinished:
        for r in arrivals.get(k, []):
            engine.add(r)
        if k in cancel_at and engine.scheduler.cancel(cancel_at[k]):
            out[cancel_at[k]][2] = "abort"
        for ev in engine.step(ahead=pipelined):
            o = out[ev.request_id]
            o[0].extend(ev.token_ids)
            o[1].append(ev.logprobs)
            o[2] = ev.finish_reason and ev.finish_reason.value
        k += 1
    assert engine.step() == [] and engine.in_flight is None  # what was left in flight says nothing
    assert engine.scheduler.allocator.num_used == 0
    return {rid: (tuple(t), tuple(lp), reason) for rid, (t, lp, reason) in out.items()}


def same(a: dict, b: dict) -> bool:
    """Equal tokens, finish reasons and top-logprob ids; logprobs equal to float32 rounding (a
    pipelined step may batch other rows beside a sequence, e.g. one a stop ends: the same math
    in a different batch shape)."""
    assert a.keys() == b.keys()
    for rid in a:
        (ta, la, ra), (tb, lb, rb) = a[rid], b[rid]
        assert (ta, ra) == (tb, rb), rid
        for x, y in zip(la, lb, strict=True):
            assert (x is None) == (y is None), rid
            if x is not None:
                assert [i for i, _ in x[1]] == [i for i, _ in y[1]], rid
                assert x[0] == pytest.approx(y[0], abs=1e-5), rid
                assert [v for _, v in x[1]] == pytest.approx([v for _, v in y[1]], abs=1e-5), rid
    return True


def both(make, arrivals_of, cancel_at=None):
    """(sequential result, pipelined result, the pipelined run's Trace) of the same workload."""
    seq_engine, pipe_engine = make(), make()
    trace = Trace(pipe_engine)
    a = drive(seq_engine, arrivals_of(seq_engine), False, cancel_at)
    b = drive(pipe_engine, arrivals_of(pipe_engine), True, cancel_at)
    return a, b, trace


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sampling", [dict(temperature=0.0, logprobs=2),
                                      dict(temperature=0.9, top_p=0.9, seed=7, logprobs=1)])
def test_pipelined_steps_give_the_sequential_tokens_and_logprobs(tiny_rads, family, sampling):
    rad = tiny_rads[family]
    ps = prompts(rad.model.vocab_size, (5, 17, 30, 9, 40), seed=21)

    def arrivals(e):  # different lengths, arriving at different steps, some ending by max_tokens early
        reqs = [request(e, f"r{i}", p, max_tokens=4 + 3 * i, **sampling) for i, p in enumerate(ps)]
        return {0: reqs[:2], 3: reqs[2:4], 7: reqs[4:]}

    seq, pipe, trace = both(lambda: small_engine(rad, max_num_batched_tokens=32), arrivals)
    assert same(pipe, seq)
    assert all(len(t) == 4 + 3 * i for i, (t, _, _) in enumerate(seq[f"r{i}"] for i in range(5)))
    assert trace.ahead > 10


@pytest.mark.parametrize("family", ("llama", "qwen3_next"))
def test_a_stop_token_ends_the_request_and_the_token_sampled_ahead_is_dropped(tiny_rads, family):
    rad = tiny_rads[family]
    ps = prompts(rad.model.vocab_size, (12, 23), seed=22)
    probe = drive(small_engine(rad), {0: [request(small_engine(rad), f"r{i}", p, max_tokens=16)
                                          for i, p in enumerate(ps)]}, False)
    stop = probe["r0"][0][5]  # r0's sixth token: a plan ahead already samples its seventh

    def arrivals(e):
        return {0: [request(e, f"r{i}", p, max_tokens=16, stop_token_ids=[stop]) for i, p in enumerate(ps)]}

    seq, pipe, trace = both(lambda: small_engine(rad), arrivals)
    assert same(pipe, seq)
    assert seq["r0"][0] == probe["r0"][0][:probe["r0"][0].index(stop) + 1] and seq["r0"][2] == "stop"
    # the step after r0's stop token was launched with r0 in it: its token was sampled and dropped
    r0_steps = [p for p in trace.plans if any(s.seq_id == 0 for s in p.seqs)]
    assert len(r0_steps) == len(seq["r0"][0]) + 1 and r0_steps[-1].seqs[0].token_ids == (PENDING,)


@pytest.mark.parametrize("family", FAMILIES)
def test_cancels_mid_stream_free_every_block_and_leave_the_others_exact(tiny_rads, family):
    rad = tiny_rads[family]
    ps = prompts(rad.model.vocab_size, (8, 20, 33), seed=23)

    def arrivals(e):
        return {0: [request(e, f"r{i}", p, max_tokens=14) for i, p in enumerate(ps)]}

    seq, pipe, trace = both(lambda: small_engine(rad), arrivals, cancel_at={5: "r1", 9: "r2"})
    assert same(pipe, seq)
    assert seq["r1"][2] == seq["r2"][2] == "abort" and len(seq["r0"][0]) == 14
    assert trace.ahead > 5


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tiny_pool_preempts_after_draining_and_every_request_still_matches(tiny_rads, family):
    rad = tiny_rads[family]
    ps = prompts(rad.model.vocab_size, (40, 44, 47, 50), seed=3)

    def make():
        return small_engine(rad, num_blocks=9, max_num_batched_tokens=64)  # 4 x 4 blocks wanted, 9 there

    def arrivals(e):
        return {0: [request(e, f"r{i}", p, max_tokens=20) for i, p in enumerate(ps)]}

    seq, pipe, trace = both(make, arrivals)
    assert same(pipe, seq)
    alone = drive(small_engine(rad), {0: [request(small_engine(rad), "r0", ps[0], max_tokens=20)]}, False)
    assert same({"r0": pipe["r0"]}, alone)
    assert trace.ahead > 0
    engine = make()
    seqs = [engine.add(r) for r in arrivals(engine)[0]]
    drive(engine, {0: []}, True)
    assert sum(s.num_preemptions for s in seqs) > 0, "the pool was meant to force a preemption"


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_cached_by_a_pipelined_request_are_exact(tiny_rads, family):
    """The prefix cache takes only blocks whose tokens update() confirmed: a next turn over a
    finished pipelined request's prompt and output (served from its cached blocks and, on the
    hybrid model, its checkpoint) gives the tokens a fresh engine computes from scratch."""
    rad = tiny_rads[family]
    p = prompts(rad.model.vocab_size, (37,), seed=24)[0]
    engine = small_engine(rad)
    trace = Trace(engine)
    first = drive(engine, {0: [request(engine, "a", p, max_tokens=27)]}, True)["a"][0]
    assert trace.ahead > 20
    turn = p + list(first) + [5, 6, 7]
    again = engine.add(request(engine, "b", turn, max_tokens=10))
    reused = drive(engine, {0: []}, True)["b"]
    assert again.num_reused_tokens >= 48
    fresh = small_engine(rad)
    assert reused == drive(fresh, {0: [request(fresh, "b", turn, max_tokens=10)]}, False)["b"]


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_penalties_pipeline_and_give_the_sequential_tokens(tiny_rads, greedy):
    """A plan made ahead samples a penalized sequence whose last output is still PENDING: the
    runner counts that token from the previous step's samples on the device. Greedy decoding with
    a strong repetition penalty makes the penalty decide tokens, so a miscounted token shows."""
    rad = tiny_rads["llama"]
    ps = prompts(rad.model.vocab_size, (6, 19), seed=25)
    sampling = dict(temperature=0.0) if greedy else dict(temperature=0.8, seed=3)

    def arrivals(e):
        return {0: [request(e, "pen", ps[0], max_tokens=24, repetition_penalty=3.0, frequency_penalty=0.5,
                            presence_penalty=0.2, **sampling),
                    request(e, "plain", ps[1], max_tokens=8)]}

    seq, pipe, trace = both(lambda: small_engine(rad), arrivals)
    assert same(pipe, seq)
    pen = [s for p in trace.plans for s in p.seqs if s.seq_id == 0]
    ahead = [s for s in pen if s.input_from is not None]
    assert len(ahead) > 10 and all(s.output_token_ids[-1] == PENDING for s in ahead)
    unpenalized = drive(small_engine(rad), {0: [request(small_engine(rad), "pen", ps[0], max_tokens=24,
                                                         **sampling)]}, False)
    assert unpenalized["pen"][0] != seq["pen"][0], "the penalties were meant to change the tokens"


MOE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, host_pool_mib=1, expert_slots=6)


@pytest.mark.parametrize("rebalance", [True, False])
def test_moe_with_the_expert_slab_counts_like_the_sequential_engine(tiny_rads, rebalance):
    """Token-to-expert assignments per layer, and each request's lookups and assignments, are the
    sequential run's (the per-step totals of distinct experts are not: a pipelined step may batch
    other sequences together). Hits are judged by the table each step's router saw; a rebalance
    after step N reaches step N+2 when N+1 is already queued, so each request's hits are compared
    with rebalancing frozen."""
    rad = tiny_rads["qwen3_moe"]
    ps = prompts(rad.model.vocab_size, (9, 33, 50), seed=51)

    def make():
        engine = Engine.build(rad, Config(**MOE), Card.from_mib(256))
        engine.pipelined = True  # a GPU's pipelined rounds, checked on the host (which steps one by one)
        if not rebalance:
            engine.experts.rebalance = lambda: 0
        return engine

    def arrivals(e):
        return {0: [request(e, f"p{i}", p, max_tokens=12) for i, p in enumerate(ps[:2])],
                2: [request(e, "p2", ps[2], max_tokens=12)]}

    runs = []
    for pipelined in (False, True):
        engine = make()
        trace = Trace(engine)
        per_request = defaultdict(lambda: [0, 0, 0, 0])
        collect = engine.runner.collect

        def counted(step, per_request=per_request):
            out = collect(step)
            for s, c in zip(step.plan.seqs, out.expert_counts):
                if c is not None:
                    per_request[s.seq_id] = [a + b for a, b in zip(per_request[s.seq_id], c)]
            return out

        engine.runner.collect = counted
        tokens = drive(engine, arrivals(engine), pipelined)
        st = engine.experts.stats
        routing = (st.routed, {k: (v[0], v[2]) for k, v in per_request.items()})
        hits = dict(per_request)
        runs.append((tokens, routing, hits, trace.ahead))
    assert same(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    assert runs[1][3] > 10
    if not rebalance:
        assert runs[0][2] == runs[1][2]


def test_the_host_backend_steps_one_after_the_other(tiny_rads):
    """On the CPU a launch computes the step: the engine plans nothing ahead, even when asked to."""
    rad = tiny_rads["llama"]
    engine = Engine.build(rad, Config(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64),
                          Card.from_mib(256))
    trace = Trace(engine)
    ps = prompts(rad.model.vocab_size, (9, 33), seed=52)
    drive(engine, {0: [request(engine, f"p{i}", p, max_tokens=8) for i, p in enumerate(ps)]}, True)
    assert not engine.pipelined and trace.ahead == 0


async def _serve(engine: Engine, ps, params) -> list:
    ae = AsyncEngine(engine)
    task = asyncio.create_task(ae.run())

    async def one(p):
        chunks = [c async for c in ae.generate(p, params)]
        return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], chunks[-1].finish_reason

    out = await asyncio.gather(*(one(p) for p in ps))
    await ae.between_steps(lambda: None)  # a stop string's cancel reaches the step thread
    assert ae.scheduler.allocator.num_used == 0
    task.cancel()
    return out


async def test_the_driver_pipelined_and_sequential_stream_the_same_text_up_to_a_stop_string(tiny_rads):
    rad = tiny_rads["llama"]
    ps = prompts(rad.model.vocab_size, (20, 7, 31), seed=26)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = await _serve(small_engine(rad), ps, greedy)
    stop = full[0][0][8:12]  # in the middle of the first request's text
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
    runs = []
    for pipelined in (False, True):
        engine = small_engine(rad)
        engine.pipelined = pipelined
        trace = Trace(engine)
        runs.append(await _serve(engine, ps, params))
        assert (trace.ahead > 10) == pipelined
    assert runs[0] == runs[1]
    assert runs[1][0][2] == "stop" and runs[1][0][0] == full[0][0][:full[0][0].index(stop)]


@pytest.mark.parametrize("family, flags", [("llama", {}), ("qwen3_moe", dict(host_pool_mib=1, expert_slots=6))])
def test_decode_graph_inputs_gathered_from_the_previous_step_give_the_eager_tokens(tiny_rads, family, flags):
    """The static decode batch (graphs.py, run eagerly on the CPU) of plans made ahead: their input
    ids are filled on the device from the previous step's sampled tokens."""
    rad = tiny_rads[family]
    ps = prompts(rad.model.vocab_size, (9, 33, 50), seed=51)  # 3 sequences: bucket 4, one padding row
    runs = []
    for graphs in (False, True):
        engine = Engine.build(rad, Config(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, **flags),
                              Card.from_mib(256))
        engine.pipelined = True  # a GPU's pipelined rounds, checked on the host (which steps one by one)
        if graphs:
            engine.runner.graphs = StepGraphs(engine.runner.model, engine.runner.cache, 4, 256 // BLOCK_TOKENS,
                                                engine.experts, capture=False)
        trace = Trace(engine)
        runs.append(drive(engine, {0: [request(engine, f"p{i}", p, max_tokens=12) for i, p in enumerate(ps)]}, True))
        assert trace.ahead > 8
    assert same(runs[0], runs[1])
