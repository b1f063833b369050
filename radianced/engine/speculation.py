"""Speculative decoding's rules: when a sequence drafts, how many tokens, and which survive.

A decode step of a drafting sequence feeds its last token and N drafted tokens
(`ScheduledSeq.drafts`) and samples at all N+1 positions, each with the
history that assumes the drafts before it. `accepted` keeps the longest prefix
of drafts that the samples reproduce, plus the first sample that differs (or
the bonus sample after the last draft): 1 to N+1 tokens for one step.

Why this is exact. The drafts are proposals with one-hot probability (n-gram
lookup proposes tokens, not distributions). The standard rejection rule
accepts draft d with probability min(1, p(d)/q(d)) = p(d) and, on rejection,
samples from the residual max(0, p - q) renormalized: p without d. Sampling t
from p and accepting d where t == d does exactly that: P(t == d) = p(d), and a
t != d is a draw from p conditioned on not being d. Greedy rows are the same
rule with p one-hot at the argmax: the output equals decoding without drafts,
token for token. Seeded rows draw position j's noise from (seed, output index),
as plain decoding does, so a seeded request's output is unchanged too.

When drafting pays (`DraftPolicy`). A verify step of B sequences with n drafts
each moves the same weights as a plain step and computes B(1+n) tokens; its
cost relative to a plain step is modelled as c(n) = (1 + r B (1+n)) / (1 + r B),
with r the compute of one token relative to one step's fixed cost (reading the
weights), measured per backend (`TOKEN_COST`). With a per-draft acceptance a,
the step yields E(n) = (1 - a^(n+1)) / (1 - a) tokens. A sequence drafts the n
(at most --speculative) that maximizes E(n) / c(n), and none where no n beats
1: so fewer as the batch grows, and none at low acceptance. Its acceptance is
estimated from its own history (a prior of 2 accepted in 4 drafted, so a new
sequence tries). A sequence also pauses when the drafter found nothing the
last `NO_MATCH_PAUSE` times it was asked (free writing rarely repeats itself):
a sequence that may draft holds the pipeline (engine/scheduler.py drains for
it), so asking in vain costs the overlap of host and device. A paused sequence
probes again every `PROBE_EVERY` steps, so a text that turns repetitive is
noticed.

r is measured before ready (engine/drafting_cost.py), then while serving (`ServedCost`): what a step costs
the user is the wall time from the previous step's end to its own, not its device time. A drafting
sequence holds the pipeline (the next step waits for its pending token), and over the expert tiers a
verify step also reads the experts its drafts route to: on the H200 at 10% slot coverage, with r = 1.3
measured before ready, n-gram drafting ran at 0.60x (bench/results/2026-12-04-h200-396d148-spec-tiers.md).
Each all-decode step's wall time goes to an average per batch size (plain steps) or, for a verify step, to
r by the cost model against the plain average at its batch size; the policy drafts by the running r.
Where drafting stops paying, only the probes draft, and each probe's step keeps r current.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from radianced.engine import ngram

# r of the cost model, per device type, until the daemon measures it before ready on the machine it serves on
# (engine/drafting_cost.py, with `token_cost_from_steps`). cpu: SmolLM2-135M fp32 on 2 cores with AMX at
# batch 1, a 5-token verify step took 71.7 ms against a plain step's 48.8 (1.47x: tools/bench_spec.py,
# bench/results/2026-12-02-cpu-*-spec.md), so r = (c - 1) / (5 - c) = 0.13; on 2 cores of an AMD EPYC without AMX
# it was 2.39x (r = 0.53: 2026-12-04-cpu-*-spec.md). cuda: a decode step at batch 1 is bound by reading the
# weights: the value assumes one token's compute is 2% of that read.
TOKEN_COST = {"cpu": 0.13, "cuda": 0.02}
PRIOR_ACCEPTED, PRIOR_DRAFTED = 2.0, 4.0
DECAY = 0.9  # weight of a sequence's older steps in its acceptance estimate, per step
SERVED_WEIGHT = 0.2  # a served step's weight in the running averages (plain steps by batch size; log r)
R_RANGE = (1e-3, 1e3)  # r as averaged: 0 (a verify step as cheap as a plain one) and inf (no draft pays) clamped
PROBE_EVERY = 16  # steps a paused sequence waits before it asks the drafter again
NO_MATCH_PAUSE = 4  # the drafter found nothing this many times in a row: pause


def accepted(sampled: Sequence[int], drafts: Sequence[int]) -> tuple[int, ...]:
    """The tokens a verify step yields: samples while they equal the draft they verify, then the first
    sample that differs or the one after the last draft. sampled: len(drafts) + 1 samples, sampled[j] at
    the position drafts[j] was proposed for."""
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return tuple(sampled[:n + 1])


def expected_tokens(acceptance: float, n: int) -> float:
    """Tokens a step with n drafts yields when each draft is accepted with probability `acceptance`
    (given the ones before it were)."""
    return float(n + 1) if acceptance >= 1.0 else (1.0 - acceptance ** (n + 1)) / (1.0 - acceptance)


def step_cost(n: int, batch: int, token_cost: float) -> float:
    """A step with n drafts per sequence over one without, for `batch` sequences (n + 1 where a token's
    compute is all of a step's cost: token_cost inf)."""
    if math.isinf(token_cost):
        return float(n + 1)
    return (1.0 + token_cost * batch * (n + 1)) / (1.0 + token_cost * batch)


def token_cost_from_steps(plain_s: float, verify_s: float, tokens: int) -> float:
    """r of the cost model measured at batch 1: a plain decode step took `plain_s`, a verify step of
    `tokens` positions (the last token and tokens - 1 drafts) `verify_s`. From c = verify_s / plain_s =
    (1 + r tokens) / (1 + r): r = (c - 1) / (tokens - c); 0 where the verify step cost no more, inf where it
    cost as much as `tokens` plain steps (then no number of drafts pays)."""
    c = verify_s / plain_s
    if c <= 1.0:
        return 0.0
    return math.inf if c >= tokens else (c - 1.0) / (tokens - c)


def best_num_drafts(acceptance: float, limit: int, batch: int, token_cost: float) -> int:
    """The n in 0..limit with the most tokens per unit of step time (0: drafting does not pay)."""
    return max(range(limit + 1), key=lambda n: (expected_tokens(acceptance, n) / step_cost(n, batch, token_cost), -n))


@dataclass(slots=True)
class DraftStats:
    """One sequence's drafting so far (the scheduler keeps it on the Sequence)."""

    drafted: int = 0  # drafts verified, all steps
    accepted: int = 0  # of them accepted
    recent_drafted: float = PRIOR_DRAFTED  # decayed counts: the acceptance estimate's terms
    recent_accepted: float = PRIOR_ACCEPTED
    idle_steps: int = 0  # steps landed without drafts since it last asked the drafter
    no_match: int = 0  # times in a row the drafter proposed nothing
    proposed: tuple[int, tuple[int, ...]] = (0, ())  # the MTP head's drafts, for a history of this many tokens

    @property
    def acceptance(self) -> float:
        return self.recent_accepted / self.recent_drafted

    def record(self, drafted: int, accepted: int) -> None:
        """A step of the sequence that sampled landed: `drafted` drafts, `accepted` of them accepted. A step
        without drafts counts towards the next probe (steps made ahead of one in flight count too: a
        paused sequence lets the pipeline run, and its probe drains it)."""
        if not drafted:
            self.idle_steps += 1
            return
        self.drafted += drafted
        self.accepted += accepted
        self.recent_drafted = DECAY * self.recent_drafted + drafted
        self.recent_accepted = DECAY * self.recent_accepted + accepted


class Drafting(Protocol):
    """What the policy reads of a sequence (engine/request.py's `Sequence`)."""

    token_ids: list[int]
    draft_stats: DraftStats
    params: Any  # its max_tokens
    num_output_tokens: int
    num_tokens: int


def ngram_drafts(seq: Drafting, n: int) -> tuple[int, ...]:
    """`--speculative-method ngram`: prompt lookup over the sequence's own tokens (engine/ngram.py)."""
    return ngram.propose(seq.token_ids, n)


def mtp_drafts(seq: Drafting, n: int) -> tuple[int, ...]:
    """`--speculative-method mtp`: what the MTP head proposed after the sequence's last step (the runner
    runs it; `StepOutput.drafts`), if it was for the history the sequence has now."""
    at, drafts = seq.draft_stats.proposed
    return drafts[:n] if at == len(seq.token_ids) else ()


def draft_limit(seq: Drafting, budget: int, max_model_len: int | None) -> int:
    """The most drafts a decode of `seq` may feed: its step yields at most drafts + 1 tokens, which must
    stay within max_tokens and max_model_len, and the drafts take the step's budget."""
    left = budget - 1
    if seq.params.max_tokens is not None:
        left = min(left, seq.params.max_tokens - seq.num_output_tokens - 1)
    if max_model_len is not None:
        left = min(left, max_model_len - seq.num_tokens - 1)
    return left


@dataclass(frozen=True)
class DraftPolicy:
    """What `--speculative N --speculative-method ngram` drafts for a sequence in a step.

    num_drafts: N, the most drafts per sequence and step.
    token_cost: r of the cost model (`TOKEN_COST` of the device type, or what the daemon's warm-up measured).
    adaptive: choose n by the cost model (off: always N where the drafter proposes N; for measuring).
    propose: the drafter: (sequence, n) -> up to n drafted tokens to follow its history (`ngram_drafts`,
        `mtp_drafts`; tests and the forced-draft benchmark replay known continuations).
    """

    num_drafts: int
    token_cost: float
    adaptive: bool = True
    propose: Callable[[Drafting, int], tuple[int, ...]] = ngram_drafts

    def num_drafts_for(self, stats: DraftStats, batch: int, limit: int) -> int:
        """How many drafts a sequence asks for in a step of `batch` decoding sequences, at most
        `limit`. Changes nothing."""
        n = min(self.num_drafts, limit)
        if n <= 0 or not self.adaptive:
            return max(n, 0)
        best = 0 if stats.no_match >= NO_MATCH_PAUSE else best_num_drafts(stats.acceptance, n, batch,
                                                                           self.token_cost)
        if best == 0 and stats.idle_steps + 1 >= PROBE_EVERY:
            best = 1  # probe: one draft tells whether the text turned predictable
        return best

    def would_draft(self, seq: Drafting, batch: int, budget: int, max_model_len: int | None) -> bool:
        """Would `drafts` ask the drafter for tokens (changes nothing)?"""
        return self.num_drafts_for(seq.draft_stats, batch, draft_limit(seq, budget, max_model_len)) > 0

    def drafts(self, seq: Drafting, batch: int, budget: int, max_model_len: int | None) -> tuple[int, ...]:
        """The drafts of a decoding sequence (its last token is computed next) in a step of `batch`
        decoding sequences with `budget` tokens left."""
        stats = seq.draft_stats
        n = self.num_drafts_for(stats, batch, draft_limit(seq, budget, max_model_len))
        if not n:
            return ()
        stats.idle_steps = 0
        drafts = self.propose(seq, n)
        stats.no_match = 0 if drafts else stats.no_match + 1
        return drafts


@dataclass
class ServedCost:
    """r of the cost model from the steps served (module docstring): `observe` each finished step."""

    plain_s: dict[int, float] = field(default_factory=dict)  # running average by batch size

    def observe(self, plan, seconds: float, r: float) -> float | None:
        """A finished step `plan` (engine/plan.py's StepPlan) took `seconds` from the previous step's end. A
        plain all-decode step updates its batch size's average; a verify step returns the new r (from `r`,
        the current one), None otherwise."""
        batch = len(plan.seqs)
        if not batch or plan.decodes != batch:
            return None  # a prompt's chunk in it: not a decode step's cost
        drafts = sum(len(s.drafts) for s in plan.seqs)
        plain = self.plain_s.get(batch)
        if not drafts:
            self.plain_s[batch] = seconds if plain is None else plain + SERVED_WEIGHT * (seconds - plain)
            return None
        if plain is None:
            return None
        # c = (1 + r (B + D)) / (1 + r B) for B sequences feeding D drafts: r = (c - 1) / (B + D - c B)
        c = seconds / plain
        room = batch + drafts - c * batch
        measured = 0.0 if c <= 1.0 else math.inf if room <= 0 else (c - 1.0) / room
        # averaged as logarithms: r spans decades (0.02 to "never"), and one odd step moves it by a factor
        was, now = (math.log(min(max(x, R_RANGE[0]), R_RANGE[1])) for x in (r, measured))
        return math.exp(was + SERVED_WEIGHT * (now - was))
