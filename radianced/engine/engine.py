"""One served model: the scheduler plans a step, the runner executes it.

`Engine.step()` is the whole loop body, one step at a time; `Engine.pipeline()`
steps with the next plan launched before the previous step is collected (the
host plans step N+1 while the device runs step N). `AsyncEngine`
(engine/driver.py) runs the pipeline with the runner on a worker thread and the
bookkeeping on the event loop.
`Engine.build` derives every pool from the budget receipt: the arena is the
receipt's elastic line, and the KV cache is a view over its pages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from radianced.arena import KV, PASSED, Arena, Fence, Lease, TenantPages, detect_card
from radianced.budget import BLOCK_TOKENS, Card, ModelFacts, Receipt, plan
from radianced.config import Config
from radianced.engine.graphs import DecodeGraphs
from radianced.engine.plan import StepPlan
from radianced.engine.request import Request
from radianced.engine.runner import InFlight, Runner
from radianced.engine.sampler import Sampler
from radianced.engine.scheduler import Scheduler, SeqEvent
from radianced.kernels import ops
from radianced.kv.blocks import BlockAllocator
from radianced.kv.prefix import PrefixCache
from radianced.kv.state import CheckpointSlots
from radianced.model.batch import KVCache, RecurrentState
from radianced.model.loader import load_model
from radianced.model.rad import RadFile
from radianced.model.tokenizer import Tokenizer
from radianced.tiers.build import build_expert_slab
from radianced.tiers.slab import ExpertSlab

log = logging.getLogger("radianced.engine")


@dataclass
class Engine:
    scheduler: Scheduler
    runner: Runner
    tokenizer: Tokenizer
    receipt: Receipt | None = None
    arena: Arena | None = None
    experts: ExpertSlab | None = None
    resources: list = field(default_factory=list)  # closed by close(): host pool, expert loader
    pipelined: bool = True  # plan ahead of the step in flight (off: --sequential-steps, the disk tier)

    def close(self) -> None:
        """Give back what lives outside torch's allocator: the expert loader's ring, fd and pinned
        staging, the host pool's CUDA registration (before its memory is unmapped)."""
        while self.resources:
            self.resources.pop().close()

    def step(self) -> list[SeqEvent]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        return self.finish(self.runner.launch(plan))

    def pipeline(self) -> Pipeline:
        """Pipelined stepping (sequential where `pipelined` is off); don't mix with `step()`
        while its step is in flight."""
        return Pipeline(self)

    def plan_ahead(self) -> StepPlan | None:
        """The plan to launch while one is in flight, or None: the engine is not `pipelined`, the
        scheduler needs the in-flight results first, or there is nothing to do."""
        plan = self.scheduler.schedule_ahead() if self.pipelined else None
        return None if plan is None or plan.is_empty else plan

    def finish(self, step: InFlight) -> list[SeqEvent]:
        """Collect a launched step, apply it, settle: the second half of a step."""
        events = self.scheduler.update(step.plan, self.runner.collect(step))
        self.settle()
        return events

    def settle(self) -> None:
        """Between steps: KV pages that hold nothing go back to the arena, hot experts take slots."""
        if self.arena is not None:
            self.scheduler.allocator.release_pages()
        if self.experts is not None:
            self.experts.rebalance()

    def add(self, request: Request):
        """Queue a request (raises QueueFull); returns its scheduler sequence (read-only for callers)."""
        return self.scheduler.add(request)

    @classmethod
    def build(cls, rad: RadFile, cfg: Config, card: Card | None = None, device: torch.device | str = "cpu",
              sampler_seed: int | None = None) -> Engine:
        """Plan the card, log the receipt, allocate the arena it describes and load the model.

        The KV cache is a view over the arena's pages (the KV tenant leases them
        block by block). Routed experts live where the receipt's placement puts
        them: pinned and cached ones in arena pages (the expert slab), the rest in
        the host pool; in lending mode KV and experts take pages from each other.
        """
        m = rad.model
        ops.select(device, deterministic=cfg.deterministic)  # once, before the model loads
        receipt = plan(card or detect_card(device), ModelFacts.from_header(rad.header), cfg)
        for line in receipt.lines():
            log.info(line)
        arena = Arena.from_receipt(receipt, device)
        dtype = rad.tensor("model.embed_tokens.weight", verify=False).dtype
        resources: list = []
        experts = build_expert_slab(rad, arena, receipt, dtype, cfg, resources) if rad.header.experts else None
        group = receipt.groups[0]
        bpp = receipt.blocks_per_page(group)
        storage = arena.paged_view(dtype, (bpp, group.layers, 2, BLOCK_TOKENS, m.num_key_value_heads, m.head_dim))
        allocator = BlockAllocator(BLOCK_TOKENS, TenantPages(arena, KV), {group.name: bpp})
        if receipt.mode == "lending":
            arena.register(KV, _KVReclaimer(allocator))
        engine = cls.assemble(rad, cfg, storage, allocator, device, experts, receipt.max_model_len, sampler_seed)
        engine.receipt, engine.arena, engine.experts, engine.resources = receipt, arena, experts, resources
        if experts is not None and experts.placement.disk and engine.pipelined:
            engine.pipelined = False  # its host sync per routed layer leaves nothing to overlap
            log.info("steps run one after the other: the disk tier reads experts with a host sync per layer")
        if torch.device(device).type == "cuda" and not cfg.enforce_eager:
            engine.runner.graphs = _decode_graphs(engine, cfg, receipt)
        return engine

    @classmethod
    def assemble(cls, rad: RadFile, cfg: Config, kv_storage: torch.Tensor, allocator: BlockAllocator,
                 device: torch.device | str = "cpu", experts=None, max_model_len: int | None = None,
                 sampler_seed: int | None = None) -> Engine:
        """Wire the model, caches, scheduler and runner over given KV storage
        ([P, N, L, 2, S, Hkv, D]) and its block allocator (tests give small pools)."""
        m = rad.model
        model = load_model(rad, device, experts=experts)
        hybrid = bool(m.linear_attention_layers)
        dtype = kv_storage.dtype
        states = RecurrentState.allocate(m, cfg.max_num_seqs, dtype, device) if hybrid else None
        # each decoding sequence keeps one checkpoint of its own; as many again stay cached for prefix hits
        n_checkpoints = 2 * cfg.max_num_seqs
        checkpoints = RecurrentState.allocate(m, n_checkpoints, dtype, device) if hybrid else None
        prefix = PrefixCache(allocator, hybrid, CheckpointSlots(n_checkpoints) if hybrid else None)
        scheduler = Scheduler(allocator=allocator, max_num_seqs=cfg.max_num_seqs,
                              max_num_batched_tokens=cfg.max_num_batched_tokens, max_queue=cfg.max_queue,
                              prefix=prefix, hybrid=hybrid, max_model_len=max_model_len)
        tokenizer = Tokenizer.from_header(rad.header)
        runner = Runner(model, KVCache(kv_storage, m.full_attention_layers, states), checkpoints,
                        Sampler(device, sampler_seed), experts if isinstance(experts, ExpertSlab) else None)
        return cls(scheduler, runner, tokenizer, pipelined=not cfg.sequential_steps)


class Pipeline:
    """Steps an engine with at most one step in flight ahead of the one being finished.

    `step()` launches the next plan (made with `Scheduler.schedule_ahead` while the
    previous step still runs), then collects and applies the previous step, and
    returns its events: on a GPU the host's collect, update and settle of step N run
    while step N+1 runs on the device. Where the next plan needs step N's results
    (the scheduler says so) or the engine is not `pipelined`, the step in flight is
    finished first. `drain()` finishes the step in flight.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.in_flight: InFlight | None = None

    def launch_next(self) -> InFlight | None:
        """Plan and launch the next step: ahead of the one in flight if it can be (else
        None: the caller finishes that first), or with none in flight. None if nothing to do."""
        engine, scheduler = self.engine, self.engine.scheduler
        if self.in_flight is None:
            plan = scheduler.schedule() if scheduler.has_unfinished else None
        else:
            plan = engine.plan_ahead()
        return None if plan is None or plan.is_empty else engine.runner.launch(plan)

    def step(self) -> list[SeqEvent]:
        """Finish one step (launching the next first where it can); its events ([] when idle)."""
        if self.in_flight is None:
            self.in_flight = self.launch_next()
            if self.in_flight is None:
                return []
        step, self.in_flight = self.in_flight, self.launch_next()
        return self.engine.finish(step)

    def drain(self) -> list[SeqEvent]:
        """Finish the step in flight, if any; its events."""
        step, self.in_flight = self.in_flight, None
        return self.engine.finish(step) if step is not None else []


def _decode_graphs(engine: Engine, cfg: Config, receipt: Receipt) -> DecodeGraphs | None:
    """Capture the decode graphs, or None where decode runs eagerly (said in the log)."""
    runner = engine.runner
    if engine.experts is not None and engine.experts.placement.disk:
        log.info("decode graphs: none, decode runs eagerly: the disk tier reads experts with a host sync "
                 "in every routed layer")
        return None
    max_blocks = -(-receipt.max_model_len // BLOCK_TOKENS)
    return DecodeGraphs(runner.model, runner.cache, cfg.max_num_seqs, max_blocks, engine.experts)


class _KVReclaimer:
    """The arena's view of the KV tenant: pages no live request uses (empty ones, then
    idle prefix-cached blocks, least recently used first) can be handed to the experts."""

    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator

    def surrenderable(self) -> int:
        pools = self.allocator.pools
        return sum(len(p.empty_pages()) for p in pools) + self.allocator.evictable() // max(
            p.blocks_per_page for p in pools)

    def reclaim_cost(self) -> float:
        return 1.0  # recompute of cached prefixes: dearer than a re-read only when the expert is cold

    def surrender(self, n: int) -> tuple[Lease, Fence]:
        return Lease(KV, tuple(self.allocator.surrender_pages(n))), PASSED
