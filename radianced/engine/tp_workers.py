"""The ranks of `--tp N` beyond the first: each holds its card's share of the model, its own paged
KV cache for its KV heads and its own recurrent-state slots for its DeltaNet heads, and runs every
step rank 0's engine plans.

Rank 0 runs the engine (scheduler, sampler, the HTTP side): its runner hands each step to
`StepBroadcast.send` before its own forward, and every rank then runs the same forward on its
shard (the collectives inside meet in the same order). What goes over is the step's layout (the
host lists `ForwardBatch.build` takes, one pickled object) and then its input ids as a tensor
(the ids a pipelined step reads from the previous step's samples are only on rank 0's device).
The block tables are rank 0's: every rank's cache has the same blocks, each holding that rank's
KV heads, so one allocator's decisions serve all; on cards with an arena each step also carries
rank 0's KV page leases and releases since the last, which the rank follows first
(engine/tp_memory.py). Sampling is rank 0's alone: the logits are gathered there.

A card's expert tiers are its own: it counts the routing to its experts, reads its misses inside
the step (over its link, or from the file with the disk tier) and rebalances its slots after the
step, as one card's engine does; after each forward its counts go to rank 0 in one all-reduce
(engine/tp_counts.py).

Speculative decoding (n-gram drafts): rank 0 drafts (the scheduler, from the sequences' tokens) and
a verify step is a step like any other, its drafts in the layout. What a verify step leaves behind
on every card: KV at the drafts' positions (the next steps' context lengths, from rank 0, make the
rejected ones dead, as on one card) and, on a hybrid model, the recurrent state after each draft in
its draft slot. Which of those becomes the sequence's depends on rank 0's samples, so rank 0 sends
the accepted counts with the next step (`WorkerStep.kept`), which every card applies before that
step's state copies, where rank 0 applied them: when it collected the verify step (no step is
planned ahead of one that drafts).

The expert profile (`radiancectl profile --save`) needs every (layer, expert) count, and each card
counts only its own experts: rank 0 gathers them when a save asks (`StepBroadcast.routing`: one
message and one reduce of a layers x experts int64 array, on the step thread between steps, where
the other ranks wait for the next step anyway), not every step. After the warm-up rank 0 restarts
its counts and the other cards restart theirs with the next message (`restart`).

MTP drafts: every card holds its share of the MTP head (sharded as a decoder layer, its KV one more
layer of the card's cache) and, after each forward, keeps the step's batch and final-normed hidden
states. When rank 0 collects the step it sends the head's pass (`MTPStep`: the next ids, which hold its
samples, and the rows to draft from) and every card runs it (engine/mtp_step.py). A pipelined rank 0
launches the next step before it collects one, so a card may run a forward before the pass of the step
before it: the kept steps are a queue, run in the order rank 0 collects them (launch order).

Not mirrored yet, refused where `--tp` is set up: CUDA decode graphs (the replay would skip the
send).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from radianced.arena import KV, Arena, PageChange
from radianced.config import Config
from radianced.engine.mtp_step import MTPStep, run_mtp
from radianced.engine.runner import copy_states, keep_states
from radianced.engine.tp_counts import CardReport, OtherCards
from radianced.engine.tp_memory import RankMemory, rank_memory
from radianced.kv.cache import KVCache, RecurrentState, kv_format
from radianced.kv.state import StateCopy
from radianced.model.batch import ForwardBatch
from radianced.model.layers import CausalLM
from radianced.model.parallel import ProcessGroup
from radianced.model.rad import RadFile
from radianced.model.sharded_loader import load_shard
from radianced.sizing import BLOCK_TOKENS
from radianced.tiers.routing import Key, RoutingTally, routing_of
from radianced.tiers.slab import ExpertSlab

log = logging.getLogger("radianced")


@dataclass(frozen=True)
class WorkerStep:
    """One step as a rank beyond the first runs it.

    kept: the verify steps' accepted drafts since the last step, (state slot, accepted drafts) where
        one was rejected (`runner.keep_states`), to keep first (hybrid models).
    before: the plan's state copies to apply before the forward (hybrid models).
    layout: `ForwardBatch.build`'s arguments but `device` (token ids, context lengths, block tables,
        block size, logits rows, state slots, drafts); the ids are then overwritten by the
        broadcast tensor.
    after: the plan's state copies to apply after the forward.
    pages: rank 0's KV page changes since the last step (`Arena.changes`), to follow first.
    segments: the rows whose expert counts rank 0 keeps apart (one per decoding sequence), or None
        when no counts are sent (a model without expert tiers).
    restart: rank 0 restarted its routing counts since the last message (after the warm-up): the
        card's count from zero, before this step.
    """

    kept: list[tuple[int, int]]
    before: tuple[StateCopy, ...]
    layout: dict
    after: tuple[StateCopy, ...]
    pages: list[PageChange]
    segments: list[tuple[int, int]] | None
    restart: bool


@dataclass(frozen=True)
class RoutingGather:
    """Rank 0 asks for every card's token-to-expert assignments (a profile save), between steps; each
    joins one reduce of its tally to rank 0. restart: as `WorkerStep.restart`, before the reduce."""

    restart: bool


class StepBroadcast:
    """Rank 0's side: each step to every other rank (`send`), the others' expert counts after its
    forward (`others`), then `close` to end their loops.

    arena: rank 0's, recording its KV tenant (`RankMemory.allocator`), or None (no arena: the
        tests' fixed pools).
    seconds: the time spent in `send` and `others` so far, steps: how many (the transport's
    per-step cost).
    """

    def __init__(self, arena: Arena | None = None) -> None:
        self.arena = arena
        self.seconds, self.steps = 0.0, 0
        self._kept: list[tuple[int, int]] = []
        self._restart = False

    def restart_counts(self) -> None:
        """Rank 0 restarted its routing counts: the other cards restart theirs with the next message."""
        self._restart = True

    def keep(self, kept: list[tuple[int, int]]) -> None:
        """Rank 0 kept these draft states (`runner.keep_states`): the other ranks keep them with the next step."""
        self._kept += kept

    def send(self, before: tuple[StateCopy, ...], layout: dict, after: tuple[StateCopy, ...],
             input_ids: torch.Tensor, segments: list[tuple[int, int]] | None) -> None:
        """The step to the other ranks: the draft states kept since the last, its layout, the KV page
        changes, the rows counted apart (None: no counts follow the forward), then its input ids."""
        start = time.perf_counter()
        pages = self.arena.changes(KV) if self.arena is not None else []
        kept, self._kept, restart, self._restart = self._kept, [], self._restart, False
        dist.broadcast_object_list([WorkerStep(kept, before, layout, after, pages, segments, restart)], src=0)
        dist.broadcast(input_ids, src=0)
        self.seconds += time.perf_counter() - start
        self.steps += 1

    def send_mtp(self, step: MTPStep) -> None:
        """The MTP head's pass of the step rank 0 collects (the oldest launched and not yet collected)."""
        start = time.perf_counter()
        dist.broadcast_object_list([step], src=0)
        self.seconds += time.perf_counter() - start

    def others(self, layers: int, segments: int, seqs: int) -> OtherCards:
        """After the forward of a step sent with segments: the other cards' expert counts."""
        start = time.perf_counter()
        received = OtherCards.receive(layers, segments, seqs)
        self.seconds += time.perf_counter() - start
        return received

    def routing(self, tally: RoutingTally) -> dict[Key, int]:
        """Every card's token-to-expert assignments since the counts restarted: rank 0's `tally` (its own
        experts') and the other cards' summed in one reduce. Run it on the step thread, between steps:
        the other ranks meet its collectives in step order (a step launched and not yet collected is
        counted by the other cards and not yet by rank 0's tally)."""
        start = time.perf_counter()
        restart, self._restart = self._restart, False
        dist.broadcast_object_list([RoutingGather(restart)], src=0)
        total = torch.from_numpy(tally.assigned.copy())
        dist.reduce(total, dst=0)
        log.info("expert profile: the routing counts of %d cards gathered in %.2f ms (%d layers x %d experts)",
                 dist.get_world_size(), 1e3 * (time.perf_counter() - start), *total.shape)
        return routing_of(tally.layers, total.numpy())

    def close(self) -> None:
        """Tell every other rank that no step follows (their `serve_steps` returns)."""
        dist.broadcast_object_list([None], src=0)


@dataclass
class WorkerShard:
    """A rank's share of the engine's device state: its model, KV cache and state checkpoints, and
    with its card's memory (`for_card`) its arena and expert tiers."""

    model: CausalLM
    cache: KVCache
    checkpoints: RecurrentState | None
    memory: RankMemory | None = None

    @classmethod
    def build(cls, rad: RadFile, cfg: Config, group: ProcessGroup, num_blocks: int, block_size: int,
              device: torch.device | str = "cpu") -> WorkerShard:
        """As `Engine.assemble` builds rank 0's (the same state slots and checkpoints, the MTP head where
        it drafts), over a cache of `num_blocks` blocks of `block_size` tokens (rank 0's count) for this
        rank's KV heads."""
        mtp = cfg.drafts_with_mtp(rad.model.num_mtp_layers)
        model = load_shard(rad, group, device, mtp=mtp)
        m = model.cfg
        storage = torch.zeros((num_blocks, 1, len(m.full_attention_layers) + mtp, 2, block_size,
                               m.num_key_value_heads, m.head_dim), dtype=model.norm.weight.dtype, device=device)
        return cls._over(model, cfg, storage, device)

    @classmethod
    def for_card(cls, rad: RadFile, cfg: Config, group: ProcessGroup,
                 device: torch.device | str = "cpu") -> WorkerShard:
        """As `Engine.build` builds rank 0's: this card's receipt, arena, KV view and expert tiers."""
        memory = rank_memory(rad, cfg, group, device)
        model = load_shard(rad, group, device, experts=memory.experts,
                           mtp=cfg.drafts_with_mtp(rad.model.num_mtp_layers))
        return cls._over(model, cfg, memory.kv_storage, device, memory)

    @classmethod
    def _over(cls, model: CausalLM, cfg: Config, storage: torch.Tensor, device: torch.device | str,
              memory: RankMemory | None = None) -> WorkerShard:
        """storage: [P, N, L, 2, S, Hkv, D], or uint8 [P, N, block bytes] for a quantized
        `cfg.kv_cache_dtype` (as `Engine.assemble` takes it; L counts the MTP layer where it drafts)."""
        m, dtype = model.cfg, model.norm.weight.dtype
        hybrid = bool(m.linear_attention_layers)
        states = RecurrentState.allocate(m, cfg.max_num_seqs, dtype, device, cfg.speculative) if hybrid else None
        kv_layers = m.full_attention_layers + ((m.num_hidden_layers,) if model.mtp is not None else ())
        cache = KVCache(storage, kv_layers, states, kv_format(cfg.kv_cache_dtype),
                        (BLOCK_TOKENS, m.num_key_value_heads, m.head_dim))
        checkpoints = RecurrentState.allocate(m, 2 * cfg.max_num_seqs, dtype, device) if hybrid else None
        return cls(model, cache, checkpoints, memory)

    def serve_steps(self) -> int:
        """Run the steps rank 0 broadcasts until it stops; returns how many ran. Closes the card's
        memory (host pool, expert loader) when it returns."""
        try:
            return self._serve()
        finally:
            if self.memory is not None:
                self.memory.close()

    def _serve(self) -> int:
        device, steps = self.cache.storage.device, 0
        slab = self.memory.experts if self.memory is not None else None
        report = CardReport(slab) if slab is not None else None
        drafting = self.model.mtp is not None
        # (batch, final-normed hidden) of each step whose MTP head pass is yet to come, in launch order
        uncollected: collections.deque[tuple[ForwardBatch, torch.Tensor]] = collections.deque()
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0)
            step: WorkerStep | RoutingGather | MTPStep | None = message[0]
            if step is None:
                return steps
            if isinstance(step, MTPStep):
                run_mtp(self.model, self.cache, *uncollected.popleft(), step)
                continue
            if slab is not None and step.restart:
                slab.tally.restart()
            if isinstance(step, RoutingGather):
                dist.reduce(torch.from_numpy(slab.tally.assigned.copy()), dst=0)
                continue
            if self.memory is not None:
                self.memory.follow(step.pages)
            keep_states(step.kept, self.cache.states)
            copy_states(step.before, self.cache.states, self.checkpoints)
            batch = ForwardBatch.build(**step.layout, device=device)
            dist.broadcast(batch.input_ids, src=0)
            counted = step.segments is not None
            if counted:
                slab.begin_step(step.segments, batch.input_ids.shape[0])
            with torch.inference_mode():
                out = self.model.forward(batch, self.cache, hidden=drafting)
            if drafting:
                uncollected.append((batch, out[1]))
            if counted:
                report.send(*_counts(slab, step.layout["token_ids"]))
            copy_states(step.after, self.cache.states, self.checkpoints)
            if slab is not None:
                slab.rebalance()
            steps += 1


def _counts(slab: ExpertSlab, token_ids: list[list[int]]) -> tuple[tuple, list[bool]]:
    """The step's expert counts per segment, and per sequence (its `token_ids`) whether an expert
    its rows routed to failed to read (said in this rank's log)."""
    record = slab.end_launch()
    rows, errors = record.failures()
    for error in errors:
        log.error("expert read failed: %s", error)
    starts = list(itertools.accumulate((len(t) for t in token_ids), initial=0))
    failed = {bisect.bisect_right(starts, r) - 1 for r in rows}
    return slab.count(record), [i in failed for i in range(len(token_ids))]
