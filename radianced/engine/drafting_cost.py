"""Speculative decoding's cost model measured on the machine that serves: r of engine/speculation.py.

A verify step of one sequence with n drafts costs c = (1 + r (n + 1)) / (1 + r) plain steps, and the
adaptive policy drafts only where the tokens it expects beat that. `TOKEN_COST` guesses r per device
type; the machine decides it: on 2 CPU cores a 5-token verify step of SmolLM2 cost 1.5 plain steps with
AMX and 2.4 without (tools/bench_spec.py). So before ready the daemon serves one sequence whose every
other decode step drafts N tokens (`alternate_drafting`), `ROUNDS` times, takes r from each verify step
against the plain step just before it (`token_cost_from_steps`) and adopts the median over the pairs.
Neighbouring steps, not two rounds' medians: on a 2-core machine starting a daemon the same plain step
took 21-30 ms from one start to the next.

It goes on measuring while it serves: speculation.py's `ServedCost`.

The start-up measurement runs on the step thread between rounds, after the loader thread has ended
(daemon.py, at the end of engine/warmup.py's `warm_up_served`), so it times the steps as they will be
served. While the loader thread lived, its OpenMP team did too, and libgomp, with more of its threads
than cores, throttles their spinning before they sleep: every parallel region then paid a wake-up, and a
q4_1 product of SmolLM2 took 86 us against 41 (2 cores); timed during the warm-up on the loader's watch,
r read 0.27-0.31 against 0.50-0.62 with one team.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import statistics

from radianced.engine.drafting import DraftPlanner
from radianced.engine.request import Request
from radianced.engine.sampling_params import SamplingParams
from radianced.engine.speculation import step_cost, token_cost_from_steps
from radianced.engine.warmup import forced_drafting, forget

TIMED = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ROUNDS = 4  # one sequence of TIMED each: ~5 pairs a round (a verify step yields a token or two)
PROMPT = 48  # tokens (fewer where the context is shorter)


def alternate_drafting(planner: DraftPlanner) -> DraftPlanner:
    """`forced_drafting`, but every other decode step drafts nothing: neighbouring plain and verify steps."""
    forced = forced_drafting(planner)
    propose, calls = forced.policy.propose, itertools.count()
    return dataclasses.replace(forced, policy=dataclasses.replace(
        forced.policy, propose=lambda seq, n: propose(seq, n) if next(calls) % 2 else ()))


def measure(engine, vocab_size: int) -> tuple[float, float] | None:
    """(the plain step's median own seconds, r) from `ROUNDS` timed rounds on `engine` (its scheduler
    drafts, nothing runs: the step thread between rounds); None where no verify step followed a plain one.
    The rounds' blocks stay cached (`forget` drops them)."""
    scheduler = engine.scheduler
    planner = scheduler.drafting
    room = (scheduler.max_model_len or PROMPT + TIMED.max_tokens + 1) - TIMED.max_tokens - 1
    if room < 1:  # no prompt leaves room for the round's tokens
        return None
    rng = random.Random(2)
    pairs: list[tuple[float, int, float]] = []  # (plain step s, the next verify step's positions, its s)
    scheduler.drafting = alternate_drafting(planner)
    try:
        for r in range(ROUNDS):
            prompt = tuple(rng.randrange(vocab_size) for _ in range(min(PROMPT, room)))
            engine.add(Request(f"drafting-cost-{r}", prompt, TIMED))
            before = None  # the last step, if a plain one-sequence decode
            while scheduler.has_unfinished:
                timed = _decode_time(engine.step_done()[0])
                if timed is not None and timed[0] > 1 and before is not None:
                    pairs.append((before, *timed))
                before = timed[1] if timed is not None and timed[0] == 1 else None
    finally:
        scheduler.drafting = planner
    if not pairs:
        return None
    return (statistics.median(p for p, _, _ in pairs),
            statistics.median(token_cost_from_steps(p, v, n) for p, n, v in pairs))


def adopt(engine, vocab_size: int) -> str | None:
    """`measure`, then the scheduler's drafting decides by the measured r; the start-up log's line (None
    where nothing was measured: the device type's r stays). The rounds' blocks are dropped."""
    measured = measure(engine, vocab_size)
    forget(engine)
    if measured is None:
        return None
    plain_s, r = measured
    planner = engine.scheduler.drafting
    engine.scheduler.drafting = dataclasses.replace(planner, policy=dataclasses.replace(planner.policy, token_cost=r))
    n = planner.policy.num_drafts
    return (f"speculative decoding's cost model measured: a decode step {1e3 * plain_s:.2f} ms, r = {r:.3g} "
            f"(a {n + 1}-token verify step costs {step_cost(n, 1, r):.2f} plain steps)")


def _decode_time(done) -> tuple[int, float] | None:
    """A finished one-sequence decode step's positions (1 + its drafts) and own time; None for any other
    step, or where its time is not known."""
    if done is None or done.output.seconds is None:
        return None
    plan = done.finished.plan
    if len(plan.seqs) != 1 or plan.decodes != 1:
        return None
    return 1 + len(plan.seqs[0].drafts), done.output.seconds
