"""Execution: `StepPlan` -> device tensors -> model -> sampler -> `StepOutput`.

The runner owns the device state of the engine: the paged KV cache, the
recurrent-state slots and checkpoints (hybrid models) and the sampler's
generators. It is called from one worker thread only; nothing above it touches
a tensor.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import replace

import torch

from radianced.engine.plan import ScheduledSeq, StepOutput, StepPlan
from radianced.engine.sampler import Sampler, SampleResult, SamplingRow, SamplingTensors
from radianced.kv.state import StateCopy
from radianced.model.batch import ForwardBatch, KVCache, RecurrentState
from radianced.model.layers import CausalLM


class Runner:
    def __init__(self, model: CausalLM, cache: KVCache, checkpoints: RecurrentState | None, sampler: Sampler,
                 eos_token_ids: tuple[int, ...] = (), experts=None):
        """experts: the expert slab (tiers/slab.py) when the model has one: the runner tells it
        which rows are which decode sequence, and returns its counts in StepOutput.expert_counts."""
        self.model, self.cache, self.checkpoints, self.sampler = model, cache, checkpoints, sampler
        self.experts = experts
        self.vocab_size = model.cfg.vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = cache.storage.device
        self.graphs = None  # DecodeGraphs (engine/graphs.py) once captured: decode steps replay them

    def run(self, plan: StepPlan) -> StepOutput:
        """Execute one step. Mutates the KV cache, state slots and checkpoints as the plan says."""
        self._copy_states(plan.before)
        seqs = plan.seqs
        decode = [i for i, s in enumerate(seqs) if _is_decode(s)]
        graph = self.graphs is not None and len(decode) == len(seqs) and self.graphs.bucket(len(seqs)) is not None
        if graph:  # every sequence feeds one token and samples: query_start is 0, 1, ..., B
            query_start = tuple(range(len(seqs) + 1))
        else:
            batch = ForwardBatch.build(
                [list(s.token_ids) for s in seqs], [s.context_before for s in seqs],
                [list(s.block_table[0]) for s in seqs], self.cache.block_size, logits=[s.sample for s in seqs],
                state_slots=[s.state_slot for s in seqs] if self.cache.states is not None else None,
                device=self.device)
            query_start = batch.query_start
        rows = [SamplingRow(s.params, s.output_token_ids, s.prompt_token_ids) for s in seqs if s.sample]
        # Host work first, device work queued back to back, then the waits: the sampling tensors are
        # built before the forward is launched, the sampler is queued behind it, and only then does the
        # host wait (the slab's copy of the step's routing, the sampled tokens).
        sampling = SamplingTensors.build(rows, self.vocab_size, self.eos_token_ids, self.device) if rows else None
        if self.experts is not None:
            self.experts.begin_step([(query_start[i], query_start[i + 1]) for i in decode], query_start[-1])
        picked = None
        try:
            if graph:
                logits = self.graphs.run([s.token_ids[0] for s in seqs], [s.context_before for s in seqs],
                                         [s.block_table[0] for s in seqs], [s.state_slot for s in seqs])
            else:
                with torch.inference_mode():
                    logits = self.model.forward(batch, self.cache)  # [R, V]: one row per sampling sequence
            if sampling is not None:
                picked = self.sampler.sample(logits, sampling)
        finally:
            counts = self.experts.end_step() if self.experts is not None else None
        errors = self._failed_seqs(query_start) if self.experts is not None else None
        self._copy_states(plan.after)
        out = StepOutput(tuple(() for _ in seqs)) if picked is None else self._output(seqs, picked)
        if counts is None:
            return out
        per_seq: list = [None] * len(seqs)
        for i, c in zip(decode, counts):
            per_seq[i] = c
        return replace(out, expert_counts=tuple(per_seq), errors=errors)

    def _failed_seqs(self, query_start: Sequence[int]) -> tuple[str | None, ...] | None:
        """Per scheduled sequence, the error of an expert read that its rows depended on, or None
        (None overall when every read of the step succeeded). Other sequences' rows never
        read a failed expert, so their results stand."""
        rows, errors = self.experts.take_failures()
        if not rows:
            return None
        failed = {bisect.bisect_right(query_start, r) - 1 for r in rows}
        message = "; ".join(errors)
        return tuple(message if i in failed else None for i in range(len(query_start) - 1))

    def _output(self, seqs: tuple[ScheduledSeq, ...], picked: SampleResult) -> StepOutput:
        """Per scheduled sequence: its sampled token (or none) and logprobs payload
        (chosen token's logprob, [(id, logprob)] of its top-N)."""
        tokens = iter(picked.tokens.tolist())  # the step's one host sync: tokens go back to the scheduler
        want = picked.logprobs is not None
        if want:
            lp = iter(zip(picked.logprobs.tolist(), picked.top_ids.tolist(), picked.top_logprobs.tolist()))
        out_tokens, out_lp = [], []
        for s in seqs:
            if not s.sample:
                out_tokens.append(())
                out_lp.append(None)
                continue
            out_tokens.append((next(tokens),))
            if want:
                chosen, ids, values = next(lp)
                n = s.params.logprobs
                out_lp.append(None if n is None else (chosen, list(zip(ids[:n], values[:n]))))
        return StepOutput(tuple(out_tokens), tuple(out_lp) if want else None)

    def _copy_states(self, copies: tuple[StateCopy, ...]) -> None:
        states = self.cache.states
        for c in copies:
            if c.op == "reset":
                states.reset(c.slot)
            elif c.op == "restore":
                self.checkpoints.copy_slot(c.checkpoint, states, c.slot)
            else:
                states.copy_slot(c.slot, self.checkpoints, c.checkpoint)


def _is_decode(s: ScheduledSeq) -> bool:
    """A decode step of a sequence: one token, the last one sampled, fed back to sample the next."""
    return s.sample and len(s.token_ids) == 1 and len(s.output_token_ids) > 0
