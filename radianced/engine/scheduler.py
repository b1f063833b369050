"""Which sequences compute which tokens each step: admission, chunked prefill,
decode, preemption. Produces a `StepPlan`; consumes the `StepOutput`.

Rules of a step (`schedule`):
1. Running sequences, decodes first, then unfinished prefills, oldest first in
   each, take tokens from the step's budget (`step_tokens`: `max_num_batched_tokens`, or
   less where the driver's pacer says, engine/pacing.py): a decode
   one, a prefill the rest of its tokens or what the budget leaves.
2. A sequence whose new tokens need blocks the pool cannot give: a prefill
   shrinks its chunk to what fits; otherwise the youngest running sequence is
   preempted (its blocks freed, recomputed later from the front of the waiting
   queue, its output so far included), until it fits or it was the youngest.
3. If nobody was preempted, waiting sequences are admitted in arrival order while
   budget, `max_num_seqs` and blocks allow; each starts after its longest prefix
   hit. The first that does not fit stops admission (FCFS: nobody overtakes).
4. Hybrid models with a prefix cache end a prefill chunk at the prompt's last
   block boundary and save a checkpoint there; a chunk that samples at a block
   boundary saves one too (kept by the sequence, cached when it ends).
   `KVManager` keeps these books: blocks, prefix hits, state slots, checkpoints.

Planning a step advances each scheduled sequence at once: its computed tokens
count the chunk, and a chunk that samples appends a PENDING token, which
`update()` replaces with the sampled one (or the sequence ends and it is dropped).

Pipelining (`schedule_ahead`): one plan may be made while the previous one is in
flight, before its `update()`. A running sequence that the in-flight plan samples
for is then scheduled optimistically on its PENDING token (`ScheduledSeq.input_from`:
the runner takes it from the previous step's sampled tokens on the device); if
that step ends it (stop token, stop string, error, cancel), its result in the
plan ahead is discarded by that plan's `update()`. A sequence the pending token
certainly ends (max_tokens, max_model_len) is not scheduled again. Where the
next plan needs the in-flight results, `schedule_ahead` returns None and the
caller drains (updates the in-flight plan, then `schedule()`): a preemption
would be needed, or the in-flight plan saves recurrent-state checkpoints (their
hand-over to the prefix cache happens in its update). Penalties pipeline: the
runner counts a PENDING output from the previous step's tokens on the device.

Speculative decoding (`drafting`: engine/drafting.py says which decodes draft, with what blocks):
`update()` lands the 1 to N+1 tokens a verify step yields, counts accepted drafts as computed, frees
blocks only rejected drafts reached. No plan ahead drafts, nor is made while a drafting one is in flight.

Device writes of a plan ahead land in stream order after the in-flight plan's
and before any later plan's, so blocks and slots that `update()` or `cancel()`
free while a plan is in flight are safe to hand out to the next `schedule()`;
the prefix cache is only given blocks whose tokens `update()` confirmed.

Contract: `schedule()` needs no plan in flight, `schedule_ahead()` exactly one;
`update()` takes the oldest plan in flight. `add`, `cancel` and `abort_all` may
come at any time; blocks of a cancelled sequence are freed at once. No torch, no CUDA.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Any

from radianced.engine.drafting import DraftPlanner
from radianced.engine.kv_manager import KVManager
from radianced.engine.plan import PENDING, StepOutput, StepPlan
from radianced.engine.plan_assembly import Chunk, scheduled
from radianced.engine.request import FinishReason, Request, Sequence, SeqStatus
from radianced.kv.blocks import BlockAllocator
from radianced.kv.prefix import PrefixCache
from radianced.kv.state import StateCopy, StateSlots


class QueueFull(RuntimeError):
    """The waiting queue holds --max-queue requests (the server answers 429)."""


@dataclass(frozen=True, slots=True)
class SeqEvent:
    """What a step did for one request: new tokens, and why it ended if it did."""

    request_id: str
    seq_id: int
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    logprobs: Any = None
    error: str | None = None  # with FinishReason.ERROR


class Scheduler:
    def __init__(self, *, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 max_queue: int, prefix: PrefixCache | None = None, hybrid: bool = False,
                 max_model_len: int | None = None):
        """max_model_len: a sequence ends ("length") when it holds this many tokens,
        whatever its max_tokens (which may be None: up to the context)."""
        if min(max_num_seqs, max_num_batched_tokens, max_queue) < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_queue must be at least 1")
        if prefix is not None and prefix.hybrid != hybrid:
            raise ValueError(f"prefix cache built for hybrid={prefix.hybrid}, scheduler for hybrid={hybrid}")
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.prefix = prefix
        self.hybrid = hybrid
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.step_tokens = max_num_batched_tokens  # the next step's budget: the flag's, or less (engine/pacing.py)
        self.max_queue = max_queue
        self.max_model_len = max_model_len
        self.drafting: DraftPlanner | None = None  # speculative decoding (None: off)
        self.state_slots = StateSlots(max_num_seqs) if hybrid else None
        self.kv = KVManager(allocator, prefix, self.state_slots)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self._by_request: dict[str, Sequence] = {}
        self._by_seq: dict[int, Sequence] = {}
        self._next_seq_id = 0
        self._finished: list[int] = []  # since the last plan with work
        self._preempted: list[int] = []
        self._in_flight: list[StepPlan] = []  # oldest first; at most two (one ahead)
        self._sample_rows: dict[int, int] = {}  # seq_id -> sampled-token row of the newest plan

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._by_request)

    @property
    def kv_util(self) -> float:
        return self.allocator.kv_util

    # -- requests in and out --------------------------------------------------

    def add(self, request: Request) -> Sequence:
        """Queue a request. Raises QueueFull when --max-queue requests already wait beyond the
        free running slots (a burst that arrives before a step admits anyone fills the slots
        first: 8 slots and --max-queue 16 take 24, not 16)."""
        if request.request_id in self._by_request:
            raise ValueError(f"request id {request.request_id!r} is already live")
        self.check_room()
        seq = Sequence(self._next_seq_id, request, self.allocator.num_groups)
        self._next_seq_id += 1
        self.waiting.append(seq)
        self._by_request[request.request_id] = seq
        self._by_seq[seq.seq_id] = seq
        return seq

    def check_room(self, arriving: int = 0) -> None:
        """Raise QueueFull unless one more request can wait beside `arriving` ones not added yet (the
        driver's, on their way to the step thread). Reads only lengths: safe from another thread."""
        queued = len(self.waiting) + arriving - max(0, self.max_num_seqs - len(self.running))
        if queued >= self.max_queue:
            raise QueueFull(f"{queued} requests are waiting (--max-queue {self.max_queue}); retry later")

    def cancel(self, request_id: str) -> bool:
        """End a request now and free its blocks and slots. False if it is not live."""
        seq = self._by_request.get(request_id)
        if seq is None:
            return False
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
            self._forget(seq, FinishReason.ABORT)
        else:
            self._finish(seq, FinishReason.ABORT)
        return True

    def abort_all(self) -> list[str]:
        """Cancel every live request; returns their ids."""
        ids = list(self._by_request)
        for request_id in ids:
            self.cancel(request_id)
        return ids

    # -- a step -----------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step, with no plan in flight (`update()` of the last one came first)."""
        if self._in_flight:
            raise RuntimeError("schedule() called before update() of the previous plan")
        return self._schedule()

    def schedule_ahead(self) -> StepPlan | None:
        """The step after the one in flight, before its `update()`; None where it needs that
        step's results (the caller updates it, then calls `schedule()`). Changes nothing then."""
        if len(self._in_flight) != 1:
            raise RuntimeError(f"schedule_ahead() needs exactly one plan in flight, not {len(self._in_flight)}")
        if self._in_flight[0].after:
            return None  # checkpoint saves in flight: update() decides whether the prefix cache takes them
        if self.drafting is not None and self.drafting.holds_pipeline(self._in_flight[0], self._by_seq,
                                                                     len(self.running), self.step_tokens):
            return None
        order = self._running_order()
        budget, need = self.step_tokens, 0
        for seq in order:  # the blocks the plan will take: without preemption or it is not made
            if budget == 0:
                break
            n = self._chunk_len(seq, seq.num_computed_tokens, budget)
            need += max(0, self.allocator.blocks_for(seq.num_computed_tokens + n) - len(seq.block_table))
            budget -= n
        if not self.allocator.can_allocate(need):
            return None
        return self._schedule(ahead=True)

    def _running_order(self) -> list[Sequence]:
        """Running sequences in the order they take budget: decodes, then prefills, oldest first."""
        live = [s for s in self.running if not (s.pending and s.at_length(s.num_tokens, self.max_model_len))]
        return [s for s in live if not s.is_prefilling] + [s for s in live if s.is_prefilling]

    def _schedule(self, ahead: bool = False) -> StepPlan:
        """ahead: a plan made while one is in flight: no drafts and no lookahead (the blocks counted
        by `schedule_ahead` are exactly the chunks' own, so nobody in flight can be preempted)."""
        budget = self.step_tokens
        chunks: dict[int, Chunk] = {}  # seq_id -> chunk, in plan order
        preempted: list[int] = []
        for seq in self._running_order():
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted for an older sequence
            n = self._chunk_len(seq, seq.num_computed_tokens, budget)
            while not self.allocator.can_append(seq.block_table, seq.num_computed_tokens + n):
                fit = (len(seq.block_table) + self.allocator.num_allocatable()) * self.block_size \
                    - seq.num_computed_tokens
                if seq.is_prefilling and fit > 0:
                    n = min(n, fit)
                    break
                victim = self.running[-1]
                budget += self._preempt(victim, chunks)
                preempted.append(victim.seq_id)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                drafts = () if ahead or self.drafting is None else self.drafting.drafts(seq, n, budget,
                                                                                        len(self.running))
                self.allocator.append(seq.block_table, seq.num_computed_tokens + n + len(drafts))
                chunks[seq.seq_id] = self._plan_chunk(seq, n, drafts=drafts)
                budget -= n + len(drafts)
        while not preempted and self.waiting and budget and len(self.running) < self.max_num_seqs:
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:
                break
            chunks[chunk.seq.seq_id] = chunk
            budget -= chunk.n
        if self.drafting is not None and not ahead:
            self.drafting.take_lookahead((c.seq, c.n, c.drafts) for c in chunks.values())
        return self._emit(chunks.values(), preempted)

    def update(self, plan: StepPlan, output: StepOutput) -> list[SeqEvent]:
        """Apply a step's results: cache the full blocks it completed, put sampled tokens in
        place of their PENDING ones, finish sequences on a stop token or max_tokens. Results of
        sequences that ended since the plan was made (cancelled, or ended by the step before a
        plan ahead) are dropped."""
        if not self._in_flight or plan is not self._in_flight[0]:
            raise RuntimeError("update() of a plan that is not the oldest in flight")
        if len(output.token_ids) != len(plan.seqs):
            raise ValueError(f"{len(output.token_ids)} outputs for {len(plan.seqs)} scheduled sequences")
        self._in_flight.pop(0)
        saved = {c.slot: c.checkpoint for c in plan.after}
        events: list[SeqEvent] = []
        for i, s in enumerate(plan.seqs):
            seq = self._by_seq.get(s.seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue  # ended while the step ran: cancelled, or by the step before it
            if output.errors is not None and output.errors[i] is not None:
                if seq.checkpoint is not None and saved.get(seq.state_slot) == seq.checkpoint:
                    seq.checkpoint_tokens = 0  # saved from this step's void state: freed, not cached
                self._finish(seq, FinishReason.ERROR)  # this step's KV is void: never cached
                events.append(SeqEvent(seq.request_id, seq.seq_id, (), FinishReason.ERROR,
                                       error=output.errors[i]))
                continue
            end = s.context_before + len(s.token_ids) - len(s.drafts)
            tokens, reason = seq.land(end, output.token_ids[i], self.max_model_len) if s.sample else ((), None)
            if reason is None and s.sample and output.drafts is not None:  # for the history these tokens end
                seq.draft_stats.proposed = (end + len(tokens), output.drafts[i])
            if s.sample and self.drafting is not None:
                seq.draft_stats.record(len(s.drafts), len(output.token_ids[i]) - 1)  # before a stop cut it
            if s.drafts:
                end += len(tokens) - 1  # the accepted drafts' KV is the sequence's
                seq.num_computed_tokens = end
            self.kv.cache_blocks(seq, end)
            if seq.checkpoint is not None and saved.get(seq.state_slot) == seq.checkpoint:
                seq.checkpoint_tokens = end
                if not s.sample:
                    self.kv.hand_over_checkpoint(seq, self._in_flight)  # the prompt's: others may use it now
            if reason is not None:
                self._finish(seq, reason)
            elif s.drafts:
                self.allocator.truncate(seq.block_table, seq.num_tokens)  # blocks only rejected drafts reached
            logprobs = output.logprobs[i] if output.logprobs is not None else None
            events += [SeqEvent(seq.request_id, seq.seq_id, (t,), reason if j == len(tokens) - 1 else None,
                                None if logprobs is None else logprobs[j]) for j, t in enumerate(tokens)]
        return events

    # -- pieces of a step ---------------------------------------------------------

    def _chunk_len(self, seq: Sequence, start: int, budget: int) -> int:
        n = min(seq.num_tokens - start, budget)
        if start < seq.checkpoint_at < start + n:
            n = seq.checkpoint_at - start  # end the chunk where the prompt checkpoint is taken
        return n

    def _admit(self, seq: Sequence, budget: int) -> Chunk | None:
        """Start the head of the waiting queue after its longest prefix hit, or None if
        its first chunk does not fit."""
        match = self.kv.match(seq)
        start = match.num_tokens
        seq.checkpoint_at = self.kv.checkpoint_at(seq, start)
        n = self._chunk_len(seq, start, budget)
        if not self.kv.can_start(match, start + n):
            return None
        self.waiting.popleft()
        before = self.kv.start(seq, match, start + n)
        seq.num_computed_tokens = start
        if seq.num_reused_tokens is None:
            seq.num_reused_tokens = start
        seq.status = SeqStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.seq_id)
        return self._plan_chunk(seq, n, before)

    def _plan_chunk(self, seq: Sequence, n: int, before: list[StateCopy] | None = None,
                    drafts: tuple[int, ...] = ()) -> Chunk:
        end = seq.num_computed_tokens + n
        return Chunk(seq, n, drafts, before or [], self.kv.checkpoint_saves(seq, end, sample=end == seq.num_tokens))

    def _emit(self, chunks, preempted: list[int]) -> StepPlan:
        self._preempted += preempted
        seqs = tuple(scheduled(c.seq, c.n, self._sample_rows, c.drafts) for c in chunks)
        if not seqs:
            return StepPlan()
        for c in chunks:  # the plan's tokens count as computed (queued), a sampled one is PENDING
            c.seq.num_computed_tokens += c.n
            if c.seq.num_computed_tokens == c.seq.num_tokens:
                c.seq.token_ids.append(PENDING)
        self._sample_rows = {s.seq_id: r for r, s in enumerate(s for s in seqs if s.sample)}
        plan = StepPlan(
            seqs=seqs,
            before=tuple(x for c in chunks for x in c.before),
            after=tuple(x for c in chunks for x in c.after),
            preempted_seq_ids=tuple(self._preempted),
            finished_seq_ids=tuple(self._finished),
        )
        self._preempted, self._finished = [], []
        self._in_flight.append(plan)
        return plan

    def _preempt(self, seq: Sequence, chunks: dict[int, Chunk]) -> int:
        """Send a running sequence back to the front of the waiting queue, to be
        recomputed; returns the budget its chunk in this plan held."""
        while seq.pending:  # (schedule_ahead counts its blocks, so it should never come to this) the token
            seq.token_ids.pop()  # in flight is dropped with the step's result; the recompute samples it again
        chunk = chunks.pop(seq.seq_id, None)
        self.running.remove(seq)
        self.kv.release(seq, self._in_flight)
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        return chunk.n + len(chunk.drafts) if chunk else 0

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        # Its blocks may still be written by a plan in flight (its discarded result, or a
        # cancelled step): they go to plans queued after it, in stream order.
        while seq.pending:
            seq.token_ids.pop()
        self.running.remove(seq)
        self.kv.release(seq, self._in_flight)
        self._finished.append(seq.seq_id)
        self._forget(seq, reason)

    def _forget(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        del self._by_request[seq.request_id]
        del self._by_seq[seq.seq_id]
