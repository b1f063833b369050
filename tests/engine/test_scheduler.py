"""The scheduler: exact plans, preemption order, queue bound, cancellation, prefix hits,
and a shadow execution of random workloads checking every plan against the tokens."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radianced.engine.plan import PENDING, ScheduledSeq, StateCopy, StepOutput, StepPlan
from radianced.engine.request import FinishReason, Request, SeqStatus
from radianced.engine.scheduler import QueueFull, Scheduler, SeqEvent
from radianced.engine.drafting import DraftPlanner
from radianced.engine.speculation import NO_MATCH_PAUSE, PROBE_EVERY, DraftPolicy
from radianced.kv.blocks import BlockAllocator
from radianced.kv.prefix import PrefixCache
from radianced.kv.state import CheckpointSlots

BS = 4


@dataclass(frozen=True)
class Params:
    max_tokens: int = 16


def make(blocks=64, max_num_seqs=4, budget=64, max_queue=8, prefix=False, hybrid=False, checkpoints=4,
         max_model_len=None):
    alloc = BlockAllocator.fixed(blocks, BS)
    cache = PrefixCache(alloc, hybrid, CheckpointSlots(checkpoints) if hybrid else None) if prefix else None
    return Scheduler(allocator=alloc, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_queue=max_queue, prefix=cache, hybrid=hybrid, max_model_len=max_model_len)


def req(rid: str, prompt, max_tokens=16, stop=()) -> Request:
    prompt = tuple(range(100, 100 + prompt)) if isinstance(prompt, int) else tuple(prompt)
    return Request(rid, prompt, Params(max_tokens), frozenset(stop))


def shape(plan: StepPlan):
    """(seq id, new tokens, context before, sample) per scheduled sequence."""
    return [(s.seq_id, len(s.token_ids), s.context_before, s.sample) for s in plan.seqs]


def step(sched: Scheduler, token=7):
    """Schedule, 'sample' `token` (or token(seq_id)) wherever the plan samples, update."""
    plan = sched.schedule()
    pick = token if callable(token) else (lambda _: token)
    out = StepOutput(tuple((pick(s.seq_id),) if s.sample else () for s in plan.seqs))
    return plan, sched.update(plan, out) if not plan.is_empty else []


def test_fcfs_admission_under_the_token_budget_with_chunked_prefill():
    sched = make(budget=16)
    for rid, n in (("a", 10), ("b", 7), ("c", 5)):
        sched.add(req(rid, n))
    plan, events = step(sched, token=50)
    assert plan.seqs[0] == ScheduledSeq(seq_id=0, token_ids=tuple(range(100, 110)), context_before=0,
                                        block_table=((0, 1, 2),), state_slot=None, sample=True,
                                        prompt_token_ids=tuple(range(100, 110)), output_token_ids=(),
                                        params=Params())
    assert shape(plan) == [(0, 10, 0, True), (1, 6, 0, False)]  # c waits: the budget is spent
    assert plan.seqs[1].block_table == ((3, 4),)
    assert events == [SeqEvent("a", 0, (50,))]
    plan, _ = step(sched)
    # decode first, then b's last prompt token, then c is admitted with what is left
    assert shape(plan) == [(0, 1, 10, True), (1, 1, 6, True), (2, 5, 0, True)]
    assert plan.seqs[0].token_ids == (50,)
    assert plan.seqs[0].output_token_ids == (50,)  # what the sampler reads for penalties and seeds
    assert plan.seqs[1].output_token_ids == ()
    assert [s.block_table for s in plan.seqs] == [((0, 1, 2),), ((3, 4),), ((5, 6),)]
    assert plan.num_tokens == 7


def test_max_num_seqs_bounds_running_sequences():
    sched = make(max_num_seqs=2)
    for rid in "abc":
        sched.add(req(rid, 3))
    plan, _ = step(sched)
    assert shape(plan) == [(0, 3, 0, True), (1, 3, 0, True)]
    assert (sched.num_running, sched.num_waiting) == (2, 1)


def test_a_full_queue_is_refused_until_a_request_ends():
    sched = make(max_num_seqs=1, max_queue=2)
    sched.add(req("a", 3))  # takes the free running slot
    sched.add(req("b", 3))
    sched.add(req("c", 3))
    with pytest.raises(QueueFull, match="2 requests are waiting \\(--max-queue 2\\)"):
        sched.add(req("d", 3))
    step(sched)  # admitting "a" frees nothing: its slot was counted already
    with pytest.raises(QueueFull, match="2 requests are waiting \\(--max-queue 2\\)"):
        sched.add(req("d", 3))
    sched.cancel("a")
    sched.add(req("d", 3))
    with pytest.raises(ValueError, match="already live"):
        sched.add(req("d", 3))


def test_a_burst_takes_the_free_running_slots_plus_max_queue():
    """Issue 19 finding 8: 60 streams at once against --max-num-seqs 8 --max-queue 16 were
    admitted 16, not 8 running + 16 queued."""
    sched = make(blocks=256, max_num_seqs=8, max_queue=16)
    for i in range(24):
        sched.add(req(f"r{i}", 3))
    with pytest.raises(QueueFull, match="16 requests are waiting \\(--max-queue 16\\)"):
        sched.add(req("r24", 3))
    step(sched)
    assert (sched.num_running, sched.num_waiting) == (8, 16)
    with pytest.raises(QueueFull, match="16 requests are waiting \\(--max-queue 16\\)"):
        sched.add(req("r24", 3))


def test_stop_token_and_max_tokens_finish_with_their_reason():
    sched = make()
    sched.add(req("a", 3, max_tokens=5, stop={9}))
    sched.add(req("b", 3, max_tokens=2))
    _, events = step(sched, token=lambda sid: 9 if sid == 0 else 4)
    assert events == [SeqEvent("a", 0, (9,), FinishReason.STOP), SeqEvent("b", 1, (4,))]
    plan, events = step(sched, token=5)
    assert events == [SeqEvent("b", 1, (5,), FinishReason.LENGTH)]
    assert plan.finished_seq_ids == (0,)  # told to the runner in the next plan
    assert not sched.has_unfinished and sched.allocator.num_used == 0
    sched.add(req("c", 2))
    plan, _ = step(sched)
    assert plan.finished_seq_ids == (1,)


def test_without_max_tokens_a_sequence_ends_at_max_model_len():
    sched = make(max_model_len=6)
    sched.add(req("a", 4, max_tokens=None))
    _, events = step(sched)
    assert events == [SeqEvent("a", 0, (7,))]
    _, events = step(sched)
    assert events == [SeqEvent("a", 0, (7,), FinishReason.LENGTH)]  # 4 + 2 tokens


def test_preemption_takes_the_youngest_and_recomputes_its_output():
    sched = make(blocks=6)
    sched.add(req("a", 8))
    sched.add(req("b", 8, max_tokens=3))
    sched.add(req("c", 7))
    plan, _ = step(sched, token=lambda sid: 10 + sid)
    assert shape(plan) == [(0, 8, 0, True), (1, 8, 0, True), (2, 7, 0, True)]
    assert sched.allocator.num_allocatable() == 0
    plan, _ = step(sched, token=lambda sid: 20 + sid)  # a and b each need a 3rd block: c goes
    assert plan.preempted_seq_ids == (2,)
    assert shape(plan) == [(0, 1, 8, True), (1, 1, 8, True)]
    assert [s.block_table for s in plan.seqs] == [((0, 1, 4),), ((2, 3, 5),)]
    assert [s.status for s in sched.waiting] == [SeqStatus.WAITING]
    plan, events = step(sched, token=lambda sid: 30 + sid)  # c does not fit yet; b ends
    assert shape(plan) == [(0, 1, 9, True), (1, 1, 9, True)]
    assert events[1] == SeqEvent("b", 1, (31,), FinishReason.LENGTH)
    plan, _ = step(sched)
    # c comes back first in line: its prompt and its one output token are recomputed, then sampled
    assert shape(plan) == [(0, 1, 10, True), (2, 8, 0, True)]
    assert plan.seqs[1].token_ids == tuple(range(100, 107)) + (12,)
    assert (plan.seqs[1].prompt_token_ids, plan.seqs[1].output_token_ids) == (tuple(range(100, 107)), (12,))


def test_preemption_order_is_youngest_first_across_several_victims():
    sched = make(blocks=4, budget=64)
    for rid in "abcd":
        sched.add(req(rid, 4))  # one full block each
    step(sched)
    plan, _ = step(sched)  # a needs a block: d goes, then b needs one: c goes
    assert plan.preempted_seq_ids == (3, 2)
    assert shape(plan) == [(0, 1, 4, True), (1, 1, 4, True)]
    assert [s.seq_id for s in sched.waiting] == [2, 3]  # the older of the two goes first


def test_a_prefill_shrinks_to_the_blocks_left_before_anyone_is_preempted():
    sched = make(blocks=4, budget=12)
    sched.add(req("a", 3))
    sched.add(req("b", 40))
    plan, _ = step(sched)
    assert shape(plan) == [(0, 3, 0, True), (1, 9, 0, False)]
    plan, _ = step(sched)
    assert shape(plan) == [(0, 1, 3, True), (1, 3, 9, False)]  # 11 wanted, 3 fit in b's blocks
    assert plan.preempted_seq_ids == ()
    plan, _ = step(sched)  # a needs a block now: b, the youngest, goes
    assert shape(plan) == [(0, 1, 4, True)]
    assert plan.preempted_seq_ids == (1,)


def test_decodes_are_planned_before_an_older_prefill():
    # hybrid + prefix: a's first chunk ends at its prompt checkpoint (28), leaving budget for b
    sched = make(budget=30, prefix=True, hybrid=True)
    sched.add(req("a", 30))
    sched.add(req("b", 2))
    plan, _ = step(sched)
    assert shape(plan) == [(0, 28, 0, False), (1, 2, 0, True)]
    sched.step_tokens = 2  # the next step's budget (the pacer's knob)
    plan, _ = step(sched)
    assert shape(plan) == [(1, 1, 2, True), (0, 1, 28, False)]


def test_hybrid_prompt_chunks_end_at_the_last_block_boundary_and_save_a_checkpoint():
    sched = make(prefix=True, hybrid=True)
    sched.add(req("a", 10))
    plan, _ = step(sched)
    assert shape(plan) == [(0, 8, 0, False)]
    assert (plan.before, plan.after) == ((StateCopy.reset(0),), (StateCopy.save(0, 0),))
    plan, _ = step(sched)
    assert shape(plan) == [(0, 2, 8, True)]
    assert (plan.before, plan.after) == ((), ())  # 10 is no block boundary
    assert sched.prefix.num_checkpoints == 1  # handed to the cache after the step that saved it


def test_hybrid_prompt_on_a_block_boundary_keeps_a_token_for_the_next_request():
    sched = make(prefix=True, hybrid=True)
    sched.add(req("a", 12))
    plan, _ = step(sched)
    assert shape(plan) == [(0, 8, 0, False)]  # a later request with this prompt resumes at 8, not 12
    plan, _ = step(sched)
    assert shape(plan) == [(0, 4, 8, True)]
    assert plan.after == (StateCopy.save(0, 1),)  # sampling at a block boundary: the sequence's own checkpoint


def test_prefix_hit_reuses_the_full_cached_blocks_of_an_earlier_turn():
    sched = make(prefix=True)
    first = sched.add(req("t1", 6, max_tokens=4))
    outs = iter([40, 41, 42, 43])
    while sched.has_unfinished:
        step(sched, token=lambda _: next(outs))
    assert first.output_token_ids == [40, 41, 42, 43]
    assert first.num_reused_tokens == 0
    # 9 tokens had KV (the last output was never fed back): two full blocks are cached
    prompt2 = tuple(range(100, 106)) + (40, 41, 42, 43, 55, 56)
    second = sched.add(req("t2", prompt2))
    plan, _ = step(sched)
    assert second.num_reused_tokens == 8
    assert shape(plan) == [(1, 4, 8, True)]
    assert plan.seqs[0].token_ids == (42, 43, 55, 56)
    assert plan.seqs[0].block_table == ((0, 1, 2),)  # t1's blocks 0 1, then a fresh one
    assert sched.allocator.ref_count(plan.seqs[0].block_table[0][:1]) == 2  # the sequence and the cache


def test_hybrid_prefix_hit_restores_the_checkpoint_of_the_finished_output():
    sched = make(prefix=True, hybrid=True)
    first = sched.add(req("t1", 10, max_tokens=3))
    outs = iter([40, 41, 42])
    plans = []
    while sched.has_unfinished:
        plans.append(step(sched, token=lambda _: next(outs))[0])
    assert [shape(p) for p in plans] == [[(0, 8, 0, False)], [(0, 2, 8, True)], [(0, 1, 10, True)],
                                        [(0, 1, 11, True)]]
    assert [p.after for p in plans] == [(StateCopy.save(0, 0),), (), (), (StateCopy.save(0, 1),)]
    assert first.output_token_ids == [40, 41, 42]
    # turn 2 shares 14 tokens; checkpoints sit at 8 (prompt) and 12 (output): it resumes at 12
    sched.add(req("t2", tuple(range(100, 110)) + (40, 41, 42, 60, 61)))
    plan, _ = step(sched)
    assert shape(plan) == [(1, 3, 12, True)]
    assert plan.before == (StateCopy.restore(checkpoint=1, slot=0),)
    # a request sharing only the first 9 prompt tokens resumes at the prompt checkpoint
    third = sched.add(req("t3", tuple(range(100, 109)) + (77, 78)))
    plan, _ = step(sched)
    assert third.num_reused_tokens == 8
    assert plan.before == (StateCopy.restore(checkpoint=0, slot=1),)


def test_hybrid_prefix_without_a_checkpoint_is_not_reused():
    sched = make(prefix=True, hybrid=True, checkpoints=1)
    sched.add(req("a", 10, max_tokens=1))  # its prompt checkpoint takes the only slot
    while sched.has_unfinished:
        step(sched)
    sched.add(req("b", tuple(range(100, 104)) + (1, 2, 3, 4, 5)))  # shares one cached block, no checkpoint at 4
    plan, _ = step(sched)
    assert shape(plan) == [(1, 8, 0, False)]
    assert plan.before == (StateCopy.reset(0),)


def test_cancel_returns_every_block_and_slot_at_once():
    sched = make(blocks=16, prefix=True, hybrid=True)
    sched.add(req("a", 10))
    sched.add(req("b", 30))
    sched.add(req("c", 3))
    plan = sched.schedule()  # in flight
    assert sched.allocator.num_used == 2 + 7 + 1  # a to its checkpoint: 8 tokens; b 28 tokens; c 3
    assert sched.cancel("b") and sched.cancel("a")
    assert sched.allocator.num_used == 1
    assert sched.state_slots.num_taken == 1
    events = sched.update(plan, StepOutput(((), (), (9,))))
    assert events == [SeqEvent("c", 2, (9,))]  # nothing for the cancelled ones
    assert sched.prefix.checkpoints.num_taken == 0  # a's save was in flight: freed, not cached
    assert not sched.cancel("a")
    sched.add(req("d", 3))
    assert sched.cancel("d")  # while waiting
    assert sched.abort_all() == ["c"]
    assert (sched.allocator.num_used, sched.state_slots.num_taken, sched.num_waiting) == (0, 0, 0)
    assert sched.allocator.num_allocatable() == 16
    assert sched.schedule() == StepPlan()


def test_cancel_keeps_a_reached_checkpoint_but_not_one_being_overwritten():
    sched = make(prefix=True, hybrid=True)
    for rid in "ab":
        sched.add(req(rid, tuple(range(100, 110)) if rid == "a" else tuple(range(200, 210))))
    for _ in range(4):  # chunks end at 8 (prompt checkpoints 0, 1), 10, 11, 12 (own checkpoints 2, 3)
        plan, _ = step(sched)
    assert plan.after == (StateCopy.save(0, 2), StateCopy.save(1, 3))
    assert sched.prefix.num_checkpoints == 2
    for _ in range(3):
        plan, _ = step(sched)
    plan = sched.schedule()  # ends at 16: both overwrite their own checkpoints
    assert plan.after == (StateCopy.save(0, 2), StateCopy.save(1, 3))
    sched.cancel("a")  # in flight: checkpoint 2 is being overwritten, so it is freed, not cached at 12
    assert (sched.prefix.num_checkpoints, sched.prefix.checkpoints.num_taken) == (2, 3)
    sched.update(plan, StepOutput(((), (7,))))
    sched.cancel("b")  # between steps: checkpoint 3 holds the state after 16 tokens; the cache keeps it
    assert (sched.prefix.num_checkpoints, sched.prefix.checkpoints.num_taken) == (3, 3)
    sched.add(req("c", tuple(range(200, 210)) + (7,) * 8))
    plan, _ = step(sched)
    assert shape(plan) == [(2, 2, 16, True)]
    assert plan.before == (StateCopy.restore(checkpoint=3, slot=0),)


def test_plans_and_updates_must_alternate():
    sched = make()
    sched.add(req("a", 3))
    plan = sched.schedule()
    with pytest.raises(RuntimeError, match="before update"):
        sched.schedule()
    with pytest.raises(ValueError, match="1 scheduled"):
        sched.update(plan, StepOutput(()))


# -- shadow execution ---------------------------------------------------------------


def next_token(history) -> int:
    """The 'model': a token that depends on the whole history (vocabulary 0..11; 0 stops)."""
    return hashlib.blake2b(bytes(history), digest_size=1).digest()[0] % 12


def alone(prompt, max_tokens) -> list[int]:
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(next_token(list(prompt) + out))
        if out[-1] == 0:
            break
    return out


class ShadowRunner:
    """Executes plans over a token-level memory: KV cells per (group, block, offset),
    recurrent state per slot and checkpoint as the token prefix it has folded in.
    Every read is checked against the sequence's true history."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.kv: dict[tuple[int, int, int], int] = {}
        self.state: dict[int, tuple[int, ...]] = {}
        self.ckpt: dict[int, tuple[int, ...]] = {}

    def run(self, plan: StepPlan, history: dict[int, list[int]]) -> StepOutput:
        assert plan.num_tokens <= self.sched.max_num_batched_tokens
        assert len({s.seq_id for s in plan.seqs}) == len(plan.seqs) <= self.sched.max_num_seqs
        for c in plan.before:
            self.state[c.slot] = () if c.op == "reset" else self.ckpt[c.checkpoint]
        for s in plan.seqs:
            end = s.context_before + len(s.token_ids)
            assert list(s.token_ids) == history[s.seq_id][s.context_before:end]
            assert s.sample == (end == len(history[s.seq_id]))
            if s.sample:
                assert list(s.prompt_token_ids + s.output_token_ids) == history[s.seq_id]
            for p, t in enumerate(s.token_ids, start=s.context_before):
                for g, table in enumerate(s.block_table):
                    self.kv[(g, table[p // BS], p % BS)] = t
        out = []
        for s in plan.seqs:
            end = s.context_before + len(s.token_ids)
            truth = history[s.seq_id][:end]
            for g, table in enumerate(s.block_table):  # attention reads the whole context
                assert [self.kv.get((g, table[p // BS], p % BS)) for p in range(end)] == truth
            if self.sched.hybrid:
                assert self.state[s.state_slot] == tuple(truth[:s.context_before])
                self.state[s.state_slot] = tuple(truth)
            out.append((next_token(truth),) if s.sample else ())
        for c in plan.after:
            self.ckpt[c.checkpoint] = self.state[c.slot]
        return StepOutput(tuple(out))


@st.composite
def workloads(draw):
    """Requests sharing a few system prompts, some of them next turns of earlier ones
    (arriving once those ended), some cancelled two steps after they arrive, between
    steps or while a step runs."""
    systems = draw(st.lists(st.lists(st.integers(1, 11), max_size=10), min_size=1, max_size=2))
    reqs = []
    for i in range(draw(st.integers(1, 8))):
        reqs.append(dict(
            wait=draw(st.integers(0, 3)),
            parent=draw(st.integers(-1, i - 1)),
            system=draw(st.sampled_from(systems)),
            fresh=draw(st.lists(st.integers(1, 11), min_size=1, max_size=8)),
            max_tokens=draw(st.integers(1, 10)),
            cancel=draw(st.sampled_from([None] * 4 + ["between steps", "in flight"])),
        ))
    return reqs


class PipelinedShadow(ShadowRunner):
    """The shadow runner of plans made ahead: a PENDING input is the token the previous plan
    sampled in row `input_from` (as the runner gathers it on the device), and each plan is
    checked against what the device knows, every sampled token included."""

    def __init__(self, sched: Scheduler):
        super().__init__(sched)
        self.known: dict[int, list[int]] = {}  # seq_id -> prompt and every token sampled for it
        self.last: list[int] = []  # the previous plan's sampled tokens, in row order

    def run(self, plan: StepPlan, history: dict[int, list[int]]) -> StepOutput:
        seqs = []
        for s in plan.seqs:
            self.known.setdefault(s.seq_id, list(history[s.seq_id]))
            if s.input_from is None:
                assert PENDING not in s.token_ids + s.output_token_ids
            else:
                assert s.token_ids == (PENDING,) and s.output_token_ids[-1] == PENDING
                token = self.last[s.input_from]
                s = replace(s, token_ids=(token,), output_token_ids=s.output_token_ids[:-1] + (token,))
            seqs.append(s)
        out = super().run(replace(plan, seqs=tuple(seqs)), self.known)
        self.last = [t[0] for t in out.token_ids if t]
        for s, t in zip(plan.seqs, out.token_ids):
            self.known[s.seq_id].extend(t)
        return out


@settings(max_examples=200, deadline=None)
@given(work=workloads(), hybrid=st.booleans(), prefix=st.booleans(), spare=st.integers(0, 4),
       max_num_seqs=st.integers(1, 4), budget=st.integers(1, 24), checkpoints=st.integers(1, 4),
       pipelined=st.booleans())
def test_any_workload_runs_as_if_each_request_ran_alone(work, hybrid, prefix, spare, max_num_seqs, budget,
                                                        checkpoints, pipelined):
    """Pipelined: each step's plan is made ahead of the previous step's update where the
    scheduler can (and the previous step is updated first where it cannot)."""
    longest = []  # an upper bound on each request's length: its pool must hold the longest
    for r in work:
        prompt = max(longest[r["parent"]] if r["parent"] >= 0 else 0, len(r["system"])) + len(r["fresh"])
        longest.append(prompt + r["max_tokens"])
    sched = make(blocks=-(-max(longest) // BS) + spare, max_num_seqs=max_num_seqs, budget=budget,
                 max_queue=64, prefix=prefix, hybrid=hybrid, checkpoints=checkpoints)
    runner = PipelinedShadow(sched) if pipelined else ShadowRunner(sched)
    in_flight = None  # pipelined: (plan, output) of the step launched ahead
    history: dict[int, list[int]] = {}
    seqs: dict[int, object] = {}  # arrival index -> Sequence
    cancel_at: dict[int, int] = {}
    pending = list(enumerate(work))
    last_arrival = 0
    for now in range(600):
        while pending:
            i, r = pending[0]
            parent = seqs.get(r["parent"])
            if now < last_arrival + r["wait"] or r["parent"] >= 0 and parent is None \
                    or parent is not None and parent.status is not SeqStatus.FINISHED:
                break
            pending.pop(0)
            last_arrival = now
            if parent is not None and parent.finish_reason is not FinishReason.ABORT:
                prompt = parent.token_ids + r["fresh"]
            else:
                prompt = r["system"] + r["fresh"]
            seqs[i] = sched.add(Request(str(i), tuple(prompt), Params(r["max_tokens"]), frozenset({0})))
            history[seqs[i].seq_id] = list(prompt)
            if r["cancel"]:
                cancel_at[i] = now + 2
        due = [i for i, when in cancel_at.items() if when == now]
        for i in due:
            if work[i]["cancel"] == "between steps":
                sched.cancel(str(i))
        if in_flight is None:
            plan = sched.schedule()
            in_flight = None if plan.is_empty else (plan, runner.run(plan, history))
        for i in due:
            if work[i]["cancel"] == "in flight":
                sched.cancel(str(i))
        ahead = sched.schedule_ahead() if pipelined and in_flight is not None else None
        launched = None if ahead is None or ahead.is_empty else (ahead, runner.run(ahead, history))
        if in_flight is not None:
            for event in sched.update(*in_flight):
                history[event.seq_id].extend(event.token_ids)
        in_flight = launched
        if not pending and not sched.has_unfinished and in_flight is None:
            break
    assert not pending and not sched.has_unfinished, "the workload did not finish in 600 steps"
    for seq in seqs.values():
        assert seq.output_token_ids == history[seq.seq_id][seq.num_prompt_tokens:]
        if seq.finish_reason is not FinishReason.ABORT:
            assert seq.output_token_ids == alone(seq.request.prompt_token_ids, seq.params.max_tokens)
    alloc = sched.allocator
    assert alloc.num_used == 0
    assert alloc.num_allocatable() == alloc.pools[0].num_leased + alloc.pages.available()
    if hybrid:
        assert sched.state_slots.num_taken == 0
        if sched.prefix is not None:
            assert sched.prefix.checkpoints.num_taken == sched.prefix.num_checkpoints


@pytest.mark.parametrize("num_blocks", range(3, 12))
def test_a_plan_ahead_with_mtp_lookahead_never_preempts_a_sequence_in_flight(num_blocks):
    """The lookahead (blocks for the MTP head's chained drafts) is taken after every chunk has its own
    blocks, from free blocks only, and never in a plan made ahead: that plan's blocks are exactly what
    `schedule_ahead` counted, so no sequence a step in flight samples for is preempted (it once was,
    and its PENDING token came back as an input id of -1)."""
    for lookahead in (0, 2, 4):
        for lens in ([3, 3], [4, 3], [3, 4, 5], [2, 6, 3]):
            sched = make(blocks=num_blocks, max_num_seqs=8)
            sched.drafting = DraftPlanner(DraftPolicy(4, 0.0, propose=lambda seq, n: ()), sched.allocator,
                                          lookahead=lookahead)  # MTP's room, drafts aside
            for i, n in enumerate(lens):
                sched.add(req(f"r{i}", n, max_tokens=40))
            plan = sched.schedule()
            for _ in range(60):
                ahead = sched.schedule_ahead()
                if ahead is not None:
                    sampled = {s.seq_id for s in plan.seqs if s.sample}
                    assert not sampled & set(ahead.preempted_seq_ids), (num_blocks, lookahead, lens)
                sched.update(plan, StepOutput(tuple((7,) if s.sample else () for s in plan.seqs)))
                assert all(PENDING not in s.token_ids for s in sched.waiting)
                plan = ahead if ahead is not None else (sched.schedule() if sched.has_unfinished else None)
                if plan is None or plan.is_empty:
                    break
                assert all(PENDING not in s.token_ids[:-1] for s in plan.seqs if s.input_from is None)


def test_a_paused_drafter_probes_again_while_the_steps_pipeline():
    """The drafter finds nothing 4 times: the sequence pauses and the steps pipeline (plans made ahead);
    those steps count towards the probe, which drains the pipeline and finds drafts again."""
    calls = []

    def propose(seq, n):
        calls.append(seq.num_tokens)
        return () if len(calls) <= NO_MATCH_PAUSE else (7,) * n

    sched = Scheduler(allocator=BlockAllocator.fixed(64, BS), max_num_seqs=4, max_num_batched_tokens=64,
                      max_queue=4)
    sched.drafting = DraftPlanner(DraftPolicy(2, 0.02, propose=propose), sched.allocator)
    sched.add(req("a", 3, max_tokens=120))
    plan, ahead_plans, drafting = sched.schedule(), 0, 0
    while plan is not None and not plan.is_empty:
        ahead = sched.schedule_ahead()
        sched.update(plan, StepOutput(tuple(((7,) * (len(s.drafts) + 1) if s.sample else ()) for s in plan.seqs)))
        ahead_plans += ahead is not None
        plan = ahead if ahead is not None else (sched.schedule() if sched.has_unfinished else None)
        drafting += bool(plan is not None and any(s.drafts for s in plan.seqs))
    assert calls[:NO_MATCH_PAUSE] == [4, 5, 6, 7]  # asked every step until it paused
    assert ahead_plans >= PROBE_EVERY - 1  # paused: the steps ran ahead ...
    assert calls[NO_MATCH_PAUSE] == 7 + PROBE_EVERY and drafting > 20  # ... until the probe, then it drafts
