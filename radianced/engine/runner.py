"""Execution: `StepPlan` -> device tensors -> model -> sampler -> `StepOutput`.

The runner owns the device state of the engine: the paged KV cache, the
recurrent-state slots and checkpoints (hybrid models) and the sampler's
generators. It is called from one worker thread only; nothing above it touches
a tensor.

A step is `launch(plan)` (queue the device work, no wait) then `collect(step)`
(wait for it, build the `StepOutput`); with pipelining the next plan is launched
before the previous step is collected, so its host work overlaps the device.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from radianced.engine.mtp_step import MTPStep, run_mtp
from radianced.engine.plan import ScheduledSeq, StepOutput, StepPlan
from radianced.engine.sampler import Sampler, SamplingRow, SamplingTensors, seeded_rows
from radianced.engine.speculation import accepted
from radianced.engine.step_timer import StepTimer
from radianced.kv.cache import KVCache, RecurrentState
from radianced.kv.state import StateCopy
from radianced.model.batch import ForwardBatch, HostLayout, copy_rows, runs_decoding, to_device_no_sync
from radianced.model.layers import CausalLM

if TYPE_CHECKING:
    from radianced.engine.tp_counts import OtherCards
    from radianced.tiers.routing import StepRecord


@dataclass
class InFlight:
    """A launched step: its device work is queued; `Runner.collect` waits for it."""

    plan: StepPlan
    query_start: tuple[int, ...]
    decode: list[int]  # indices of plan.seqs that are decode steps, drafts or not (their expert counts)
    host: tuple | None  # (tokens [R], logprobs [R], top ids [R, N], top logprobs [R, N]) on the host
    done: torch.cuda.Event | None  # after the copies to `host` (CUDA)
    routing: StepRecord | None  # the slab's record of the step
    timer: StepTimer  # the step's own time on the device (the pacer's)
    mtp: tuple[ForwardBatch, torch.Tensor] | None = None  # (the batch, its final-normed hidden [T, H]): MTP reads it
    others: OtherCards | None = None  # under --tp N: the other cards' expert counts of the step


class Runner:
    def __init__(self, model: CausalLM, cache: KVCache, checkpoints: RecurrentState | None, sampler: Sampler,
                 experts=None):
        """experts: the expert slab (tiers/slab.py) when the model has one: the runner tells it
        which rows are which decode sequence, and returns its counts in StepOutput.expert_counts."""
        self.model, self.cache, self.checkpoints, self.sampler = model, cache, checkpoints, sampler
        self.experts = experts
        self.vocab_size = model.cfg.vocab_size
        self.device = cache.storage.device
        self.graphs = None  # StepGraphs (engine/graphs.py) once captured: steps that fit one replay it
        self.workers = None  # StepBroadcast (engine/tp_workers.py) under --tp N: the other ranks run each step too
        self.mtp_drafts = 1  # drafts the MTP head chains per sequence and step (--speculative)
        self._last_tokens: torch.Tensor | None = None  # [R] the last launched step's sampled ids (device)
        self._sampling: tuple[list, SamplingTensors] | None = None  # (rows' params, their tensors): last step's

    def run(self, plan: StepPlan) -> StepOutput:
        """Execute one step: `collect(launch(plan))`."""
        return self.collect(self.launch(plan))

    def launch(self, plan: StepPlan) -> InFlight:
        """Queue all device work of a step and return without waiting for it: state copies, the
        forward (graph replay or eager), the sampler, and copies of the sampled tokens and the
        slab's routing to the host. Mutates the KV cache, state slots and checkpoints as the plan
        says, in stream order after every step launched before. A sequence with `input_from`
        reads its input token from the previous launched step's sampled tokens, on the device."""
        timer = StepTimer(self.device)
        self._copy_states(plan.before)
        seqs = plan.seqs
        decode = [i for i, s in enumerate(seqs) if _is_decode(s)]
        graph = self.graphs is not None and len(decode) == len(seqs) and not any(s.drafts for s in seqs) \
            and self.graphs.bucket(len(seqs)) is not None
        query_start = tuple(range(len(seqs) + 1)) if graph else \
            tuple(itertools.accumulate((len(s.token_ids) for s in seqs), initial=0))
        wanted = [(1 + len(s.drafts)) * s.sample for s in seqs]  # logits rows of each sequence
        states = self.cache.states is not None
        mixed = not graph and self.graphs is not None and \
            self.graphs.mixed_bucket(query_start[-1], sum(wanted), len(seqs)) is not None and \
            (not states or all(runs_decoding(len(s.token_ids), len(s.drafts)) for s in seqs))  # a hybrid's verify step
        pending = self._pending_inputs(seqs, query_start)
        segments = [(query_start[i], query_start[i + 1]) for i in decode]
        if self.experts is not None:
            self.experts.begin_step(segments, query_start[-1])
        picked, routing, mtp, others = None, None, None, None
        try:
            if graph:  # every sequence feeds one token and samples: query_start is 0, 1, ..., B
                logits = self.graphs.run([s.token_ids[0] for s in seqs], [s.context_before for s in seqs],
                                         [s.block_table[0] for s in seqs], [s.state_slot for s in seqs], pending)
            elif mixed:  # any other step that fits a mixed graph (engine/graphs.py): the eager layout, replayed
                logits = self.graphs.run_mixed(HostLayout.of(**self._layout(seqs, wanted)), pending,
                                               [s.state_slot for s in seqs] if states else None)
            else:
                layout = dict(self._layout(seqs, wanted), drafts=[len(s.drafts) for s in seqs],
                              state_slots=[s.state_slot for s in seqs] if self.cache.states is not None else None)
                batch = ForwardBatch.build(**layout, device=self.device)
                if pending is not None:
                    copy_rows(batch.input_ids, *pending)
                if self.workers is not None:  # each card counts its own experts: theirs follow the forward
                    self.workers.send(plan.before, layout, plan.after, batch.input_ids,
                                      segments if self.experts is not None else None)
                with torch.inference_mode():
                    logits = self.model.forward(batch, self.cache, hidden=self.model.mtp is not None)
                if self.workers is not None and self.experts is not None:
                    others = self.workers.others(len(self.experts.stats.layers), len(segments), len(seqs))
                if self.model.mtp is not None:
                    logits, hidden = logits
                    mtp = (batch, hidden)
            # Queued behind the forward: the sampling tensors are built (host work, copied without a
            # sync) while the device runs it.
            rows = [SamplingRow(s.params, s.output_token_ids + s.drafts[:j], s.prompt_token_ids)
                    for s in seqs if s.sample for j in range(len(s.drafts) + 1)]
            if rows:
                picked = self.sampler.sample(logits, self._sampling_tensors(rows, self._pending_outputs(seqs, pending)))
        finally:
            if self.experts is not None:
                routing = self.experts.end_launch()
        self._copy_states(plan.after)
        timer.stop()
        self._last_tokens = None if picked is None else picked.tokens
        host, done = None, None
        if picked is not None:
            host = tuple(None if t is None else _to_host_no_wait(t)
                         for t in (picked.tokens, picked.logprobs, picked.top_ids, picked.top_logprobs))
            if self.device.type == "cuda":
                done = torch.cuda.Event()
                done.record()
        return InFlight(plan, query_start, decode, host, done, routing, timer, mtp, others)

    def _layout(self, seqs: tuple[ScheduledSeq, ...], wanted: list[int]) -> dict:
        """A step's rows as `HostLayout.of` takes them (`ForwardBatch.build` too, with the states and drafts)."""
        return dict(token_ids=[list(s.token_ids) for s in seqs], context_before=[s.context_before for s in seqs],
                    block_tables=[list(s.block_table[0]) for s in seqs], block_size=self.cache.block_size,
                    logits=wanted)

    def collect(self, step: InFlight) -> StepOutput:
        """Wait for a launched step (steps are collected in launch order) and return its output."""
        if step.done is not None:
            step.done.synchronize()  # deliberate: the step's tokens go back to the scheduler
        seqs = step.plan.seqs
        counts = self.experts.count(step.routing) if step.routing is not None else None
        errors = self._failed_seqs(step.routing, step.query_start) if step.routing is not None else None
        if step.others is not None:
            counts, errors = step.others.added(self.experts.stats, counts, errors)
        out = StepOutput(tuple(() for _ in seqs)) if step.host is None else self._output(seqs, step.host)
        out = replace(out, seconds=step.timer.seconds())
        if self.cache.states is not None:
            self._keep_accepted_states(seqs, out.token_ids)
        if step.mtp is not None:
            out = replace(out, drafts=self._mtp_drafts(step, out.token_ids))
        if counts is None:
            return out
        per_seq: list = [None] * len(seqs)
        for i, c in zip(step.decode, counts):
            per_seq[i] = c
        return replace(out, expert_counts=tuple(per_seq), errors=errors)

    def _mtp_drafts(self, step: InFlight, yielded: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
        """The MTP head's pass over every row of the step (engine/mtp_step.py: each row's hidden state with
        the token after it: the next row's input, the row's own sample where it sampled, or the chunk's
        `next_token_id`); its drafts for each sampling sequence, read at the row of the last token the step
        yields (where a verify step's accepted drafts end) and chained from there. Under --tp the other
        cards run the same pass (`StepBroadcast.send_mtp`)."""
        batch, hidden = step.mtp
        samples = step.host[0].tolist() if step.host is not None else []
        next_ids, rows, positions, tables, r = [], [], [], [], 0
        for i, s in enumerate(step.plan.seqs):
            inputs = list(s.token_ids)
            if s.sample:
                k = len(s.drafts) + 1  # the sampled rows: the last k
                next_ids += inputs[1:len(inputs) - k + 1] + samples[r:r + k]
                row = len(inputs) - k + len(yielded[i]) - 1  # within the sequence's rows
                rows.append(step.query_start[i] + row)
                positions.append(s.context_before + row)
                tables.append(list(s.block_table[0]))
                r += k
            else:
                next_ids += inputs[1:] + [s.next_token_id]
        mtp_step = MTPStep(next_ids, rows, positions, tables, self.mtp_drafts)
        if self.workers is not None:
            self.workers.send_mtp(mtp_step)
        chains = iter(run_mtp(self.model, self.cache, batch, hidden, mtp_step))
        return tuple(next(chains) if s.sample else () for s in step.plan.seqs)

    def _keep_accepted_states(self, seqs: tuple[ScheduledSeq, ...], yielded: tuple[tuple[int, ...], ...]) -> None:
        """A hybrid model's verify steps: the state after the last accepted position becomes the
        sequence's (queued before any later step: a plan that drafts is never planned ahead of). Under
        --tp the other ranks keep the same with the next step (`StepBroadcast.keep`)."""
        kept = [(s.state_slot, len(tokens) - 1) for s, tokens in zip(seqs, yielded)
                if s.drafts and len(tokens) - 1 < len(s.drafts)]
        keep_states(kept, self.cache.states)
        if self.workers is not None:
            self.workers.keep(kept)

    def _pending_inputs(self, seqs: tuple[ScheduledSeq, ...],
                        query_start: tuple[int, ...]) -> tuple[torch.Tensor | slice, torch.Tensor] | None:
        """(token rows [P] on the device, or a slice; their ids [P] on the device) of the sequences
        whose input is the previous step's sampled token (`input_from`), or None. A gather queued on
        the stream: stream order puts it after the previous step's sampler, so nothing waits for it.
        A steady decode batch (row i feeds the previous step's sample i) takes the samples as they
        are: a slice, no index copy and no gather."""
        rows = [(query_start[i], s.input_from) for i, s in enumerate(seqs) if s.input_from is not None]
        if not rows:
            return None
        if self._last_tokens is None:
            raise RuntimeError("a plan made ahead reads the previous step's tokens, and no step that sampled "
                               "was launched before it")
        if all(d == i and src == i for i, (d, src) in enumerate(rows)):
            return slice(0, len(rows)), self._last_tokens[:len(rows)]
        dst, src = to_device_no_sync(torch.tensor(list(zip(*rows)), dtype=torch.int64), self.device)  # one copy
        return dst, self._last_tokens.index_select(0, src)

    def _pending_outputs(self, seqs: tuple[ScheduledSeq, ...],
                         pending: tuple[torch.Tensor | slice, torch.Tensor] | None,
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(sampling rows [P], ids [P] on the device) of the sequences whose last output is PENDING
        (their input this step: the ids `_pending_inputs` gathered), for the penalties' counts;
        None when no such sequence has penalties."""
        if pending is None or not any(s.input_from is not None and getattr(s.params, "has_penalties", False)
                                      for s in seqs):
            return None
        first_rows = itertools.accumulate(((1 + len(s.drafts)) * s.sample for s in seqs), initial=0)
        rows = [r for r, s in zip(first_rows, seqs) if s.input_from is not None]
        return to_device_no_sync(torch.tensor(rows, dtype=torch.int64), self.device), pending[1]

    def forget_sampling(self) -> None:
        """Drop the last step's sampling tensors (its penalty histories stay on the card otherwise); the next
        step builds its own. After the warm-up, whose last rows were nobody's."""
        self._sampling = None

    def _sampling_tensors(self, rows: list[SamplingRow],
                          pending: tuple[torch.Tensor, torch.Tensor] | None = None) -> SamplingTensors:
        """The step's SamplingTensors. Decode steps of one batch repeat the same rows' params: their
        tensors are the last step's (only the per-step seeds change), unless penalties read the
        histories (then `pending` gives the rows' PENDING output ids on the device). The cache holds
        the params objects themselves, compared by identity."""
        params = [r.params for r in rows]
        last = self._sampling
        if last is not None and not last[1].do_penalties and len(last[0]) == len(params) \
                and all(a is b for a, b in zip(last[0], params)):
            return replace(last[1], seeded=seeded_rows(rows))
        tensors = SamplingTensors.build(rows, self.vocab_size, self.device, pending)
        self._sampling = (params, tensors)
        return tensors

    def _failed_seqs(self, routing: StepRecord, query_start: Sequence[int]) -> tuple[str | None, ...] | None:
        """Per scheduled sequence, the error of an expert read that its rows depended on, or None
        (None overall when every read of the step succeeded). Other sequences' rows never
        read a failed expert, so their results stand."""
        rows, errors = routing.failures()
        if not rows:
            return None
        failed = {bisect.bisect_right(query_start, r) - 1 for r in rows}
        message = "; ".join(errors)
        return tuple(message if i in failed else None for i in range(len(query_start) - 1))

    def _output(self, seqs: tuple[ScheduledSeq, ...], host: tuple) -> StepOutput:
        """Per scheduled sequence: the tokens its step yields (none; its sampled one; or, where it
        drafted, the drafts its samples accept and one more) and their logprobs payloads (chosen
        token's logprob, [(id, logprob)] of its top-N)."""
        tokens, logprobs, top_ids, top_logprobs = host
        tokens = tokens.tolist()
        want = logprobs is not None
        if want:
            lp = list(zip(logprobs.tolist(), top_ids.tolist(), top_logprobs.tolist()))
        out_tokens, out_lp, row = [], [], 0
        for s in seqs:
            if not s.sample:
                out_tokens.append(())
                out_lp.append(None)
                continue
            kept = accepted(tokens[row:row + len(s.drafts) + 1], s.drafts)
            out_tokens.append(kept)
            n = s.params.logprobs
            if want:
                out_lp.append(None if n is None else tuple(
                    (chosen, list(zip(ids[:n], values[:n]))) for chosen, ids, values in lp[row:row + len(kept)]))
            row += len(s.drafts) + 1
        return StepOutput(tuple(out_tokens), tuple(out_lp) if want else None)

    def _copy_states(self, copies: tuple[StateCopy, ...]) -> None:
        copy_states(copies, self.cache.states, self.checkpoints)


def copy_states(copies: tuple[StateCopy, ...], states: RecurrentState | None, checkpoints: RecurrentState | None) -> None:
    """Apply a plan's state copies (reset a slot, restore it from a checkpoint, save it to one), in order."""
    for c in copies:
        if c.op == "reset":
            states.reset(c.slot)
        elif c.op == "restore":
            checkpoints.copy_slot(c.checkpoint, states, c.slot)
        else:
            states.copy_slot(c.slot, checkpoints, c.checkpoint)


def keep_states(kept: Sequence[tuple[int, int]], states: RecurrentState) -> None:
    """For each (state slot, a) of a verify step that accepted a of its drafts and rejected the next: the
    state after those a (`RecurrentState.draft_slot` a) becomes the sequence's."""
    for slot, position in kept:
        states.copy_slot(states.draft_slot(slot, position), states, slot)


def _is_decode(s: ScheduledSeq) -> bool:
    """A decode step of a sequence: the last token sampled fed back (with its drafts, if any) to sample
    the next."""
    return s.sample and len(s.token_ids) == 1 + len(s.drafts) and len(s.output_token_ids) > 0


def _to_host_no_wait(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host: from a GPU, a pinned buffer of its own filled by a queued copy (read it
    after the step's event)."""
    if t.device.type != "cuda":
        return t
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
