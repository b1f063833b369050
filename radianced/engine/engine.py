"""One served model, stepped by one loop in three phases.

A step is planned, executed and applied, and every caller drives those three
phases: the daemon's driver (engine/driver.py: all three on its step thread,
the event loop only handing it requests and taking its tokens), `step()` for
synchronous callers (tests, benchmarks, the profiling run), and nothing else.

- `plan(ahead)` (bookkeeping, no torch): the work of the next round, a `Work`:
  the plan to launch, and the step in flight to collect after launching it.
  With a step in flight and `ahead`, the next plan is made before that step's
  results exist (`Scheduler.schedule_ahead`): the host plans step N+1 while the
  device runs step N. Where the scheduler needs step N's results first, or the
  engine is not `pipelined`, the round only collects.
- `execute(work)` (the runner, on one thread): launch, then collect; `Executed`.
- `apply(executed)` (bookkeeping): the scheduler's update of the collected step,
  then `settle` (idle KV pages back to the arena, hot experts into slots); the
  step's `SeqEvent`s.

`Engine.build` derives every pool from the budget receipt: the arena is the
receipt's elastic line, and the KV cache is a view over its pages.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from radianced import budget
from radianced.arena import KV, Arena, TenantPages
from radianced.card import Card, MiB, detect_card
from radianced.config import Config, ConfigError
from radianced.engine.graphs import StepGraphs
from radianced.engine.plan import StepOutput, StepPlan
from radianced.engine.request import Request
from radianced.engine.runner import InFlight, Runner
from radianced.engine.sampler import Sampler
from radianced.engine.scheduler import Scheduler, SeqEvent
from radianced.engine.drafting import DraftPlanner
from radianced.engine.speculation import TOKEN_COST, DraftPolicy, mtp_drafts, ngram_drafts
from radianced.engine.tp_memory import plan_ranks, rank_memory, refuse_device
from radianced.engine.tp_workers import StepBroadcast
from radianced.graph_shapes import mixed_buckets_of, no_graphs
from radianced.kernels import ops
from radianced.kv.blocks import BlockAllocator
from radianced.kv.cache import KVCache, RecurrentState, kv_format
from radianced.kv.prefix import PrefixCache
from radianced.kv.reclaimer import KVReclaimer
from radianced.kv.state import CheckpointSlots
from radianced.model.loader import activation_dtype, load_model
from radianced.model.parallel import SINGLE, Group
from radianced.model.rad import RadFile
from radianced.model.sharded_loader import load_shard
from radianced.model.tokenizer import Tokenizer
from radianced.receipt import Receipt
from radianced.sizing import BLOCK_TOKENS, ModelFacts
from radianced.tiers.build import build_expert_slab
from radianced.tiers.routing import Key
from radianced.tiers.slab import ExpertSlab
from radianced.tp_plan import CardsReceipt

log = logging.getLogger("radianced.engine")


@dataclass(frozen=True)
class Work:
    """One round of the loop, as `Engine.plan` made it.

    launch: the plan to launch, or None (the round only collects).
    collect: the step in flight to collect after the launch, or None.
    wait: collect `launch`'s own step in the same round (nothing is left in flight).
    """

    launch: StepPlan | None
    collect: InFlight | None
    wait: bool


@dataclass(frozen=True)
class Executed:
    """What `Engine.execute` did.

    launched: the step it launched and left in flight, or None.
    finished: the step it collected, or None.
    output: `finished`'s output (None with it).
    launch_s, launch_cpu_s: the launch's wall time and the launching thread's CPU time in it (0 without a
        launch): on CUDA a launch only queues work, so wall well past CPU is the thread waiting (for the GIL,
        while the event loop runs Python), not working.
    """

    launched: InFlight | None
    finished: InFlight | None
    output: StepOutput | None
    launch_s: float = 0.0
    launch_cpu_s: float = 0.0


@dataclass
class Engine:
    scheduler: Scheduler
    runner: Runner
    tokenizer: Tokenizer
    receipt: Receipt | None = None
    cards: CardsReceipt | None = None  # under --tp N: every card's receipt (`receipt` is this card's)
    arena: Arena | None = None
    experts: ExpertSlab | None = None
    resources: list = field(default_factory=list)  # closed by close(): host pool, expert loader
    pipelined: bool = True  # plan ahead of the step in flight (off: --sequential-steps, the disk tier)
    _in_flight: InFlight | None = field(default=None, init=False, repr=False)
    _last_done: float | None = field(default=None, init=False, repr=False)  # when the last step ended, if busy since

    def close(self) -> None:
        """Give back what lives outside torch's allocator: the expert loader's ring, fd and pinned
        staging, the host pool's CUDA registration (before its memory is unmapped)."""
        while self.resources:
            self.resources.pop().close()

    @property
    def in_flight(self) -> InFlight | None:
        """The step launched and not yet collected, if any."""
        return self._in_flight

    def plan(self, ahead: bool = True) -> Work | None:
        """The next round's work, or None when there is nothing to run (no step in flight and
        nothing the scheduler can plan). ahead: plan the next step while one is in flight, where
        the engine is `pipelined` and the scheduler can (else the round collects only, and a
        fresh plan is launched and collected in one round)."""
        if self._in_flight is None:
            plan = self.scheduler.schedule() if self.scheduler.has_unfinished else None
            if plan is None or plan.is_empty:
                self._last_done = None  # idle: the next step's time since it is not the step's cost
                return None
            return Work(plan, None, wait=not (ahead and self.pipelined))
        plan = self.scheduler.schedule_ahead() if ahead and self.pipelined else None
        return Work(None if plan is None or plan.is_empty else plan, self._in_flight, wait=False)

    def execute(self, work: Work) -> Executed:
        """Launch the work's plan, then collect the step it finishes: the runner's half of a round
        (the driver's worker thread; nothing else calls the runner)."""
        launched, wall, cpu = None, 0.0, 0.0
        if work.launch is not None:
            wall, cpu = time.perf_counter(), time.thread_time()
            launched = self.runner.launch(work.launch)
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        finished = launched if work.wait else work.collect
        if work.wait:
            launched = None
        return Executed(launched, finished, self.runner.collect(finished) if finished is not None else None, wall, cpu)

    def apply(self, done: Executed) -> list[SeqEvent]:
        """The bookkeeping half of a round: the step launched stays in flight; the step collected
        updates the scheduler, then the engine settles (the slab's expert copies, queued behind the
        step in flight, reach the step after it). Its events ([] when none was collected)."""
        self._in_flight = done.launched
        if done.finished is None:
            return []
        if self.scheduler.drafting is not None:  # speculation's cost model, from the steps' wall times
            now = time.perf_counter()
            if self._last_done is not None:
                self.scheduler.drafting.observe(done.finished.plan, now - self._last_done)
            self._last_done = now
        events = self.scheduler.update(done.finished.plan, done.output)
        self.settle()
        return events

    def step(self, ahead: bool = False) -> list[SeqEvent]:
        """Rounds of `apply(execute(plan(ahead)))`, synchronously, until one finishes a step; that
        step's events ([] when there was nothing to run). By default nothing stays in flight; with
        `ahead`, the daemon's pipelined rounds: the next step is launched before this one is
        collected, and stays in flight (`step()` finishes it)."""
        return self.step_done(ahead)[1]

    def step_done(self, ahead: bool = False) -> tuple[Executed | None, list[SeqEvent]]:
        """`step`, with the round that finished the step (its plan, output and own time:
        engine/drafting_cost.py's timings), or None when there was nothing to run."""
        while (work := self.plan(ahead)) is not None:
            done = self.execute(work)
            events = self.apply(done)
            if done.finished is not None:
                return done, events
        return None, []

    def settle(self) -> None:
        """Between steps: KV pages that hold nothing go back to the arena, hot experts take slots."""
        if self.arena is not None:
            self.scheduler.allocator.release_pages()
        if self.experts is not None:
            self.experts.rebalance()

    def expert_routing(self) -> dict[Key, int]:
        """Token-to-expert assignments since the counts restarted, per (layer, expert) routed: the slab's,
        and under --tp every card's, gathered from the other ranks (a collective: call it on the step
        thread, between steps)."""
        workers = self.runner.workers
        return self.experts.routing if workers is None else workers.routing(self.experts.tally)

    def add(self, request: Request):
        """Queue a request (raises QueueFull); returns its scheduler sequence (read-only for callers)."""
        return self.scheduler.add(request)

    @classmethod
    def build(cls, rad: RadFile, cfg: Config, card: Card | None = None, device: torch.device | str = "cpu",
              sampler_seed: int | None = None, group: Group = SINGLE) -> Engine:
        """Plan the card, log the receipt, allocate the arena it describes and load the model.

        The KV cache is a view over the arena's pages (the KV tenant leases them
        block by block). Routed experts live where the receipt's placement puts
        them: pinned and cached ones in arena pages (the expert slab), the rest in
        the host pool; in lending mode KV and experts take pages from each other.
        Over a `group` of `--tp` ranks, rank 0's engine over its card (`_build_rank`).
        """
        if group.size > 1:
            return cls._build_rank(rad, cfg, group, device, sampler_seed)
        m = rad.model
        ops.select(device, deterministic=cfg.deterministic)  # once, before the model loads
        receipt = budget.plan(card or detect_card(device), ModelFacts.from_header(rad.header), cfg)
        for line in receipt.lines():
            log.info(line)
        arena = Arena.from_receipt(receipt, device)
        dtype = activation_dtype(rad)
        resources: list = []
        experts = build_expert_slab(rad, arena, receipt, dtype, cfg, resources) if rad.header.experts else None
        group = receipt.groups[0]
        bpp = receipt.blocks_per_page(group)
        if cfg.kv_cache_dtype == "auto":
            storage = arena.paged_view(dtype, (bpp, group.layers, 2, BLOCK_TOKENS, m.num_key_value_heads, m.head_dim))
        else:  # quantized blocks: codes and scales of all layers, the receipt's block_bytes each
            storage = arena.paged_view(torch.uint8, (bpp, group.block_bytes))
        allocator = BlockAllocator(BLOCK_TOKENS, TenantPages(arena, KV), {group.name: bpp})
        if receipt.mode == "lending":
            arena.register(KV, KVReclaimer(allocator))
        engine = cls.assemble(rad, cfg, storage, allocator, device, experts, receipt.max_model_len, sampler_seed)
        engine.receipt, engine.arena, engine.experts, engine.resources = receipt, arena, experts, resources
        if experts is not None and experts.placement.disk and engine.pipelined:
            engine.pipelined = False  # its host sync per routed layer leaves nothing to overlap
            log.info("steps run one after the other: the disk tier reads experts with a host sync per layer")
        if torch.device(device).type != "cuda" and engine.pipelined:
            # A host launch computes the step: planning ahead overlaps nothing and hands each token to its
            # stream a step late (SmolLM2, 2 cores, c = 8: TTFT 568-633 ms pipelined, 231-372 ms not, the same
            # tok/s; bench/results/2026-12-03-cpu-02ecfbb-served-c8-breakdown.md).
            engine.pipelined = False
            log.info("steps run one after the other: on the host a step is computed as it is launched")
        engine.runner.graphs = _step_graphs(engine, cfg, receipt, torch.device(device).type == "cuda")
        return engine

    @classmethod
    def _build_rank(cls, rad: RadFile, cfg: Config, group: Group, device: torch.device | str,
                    sampler_seed: int | None) -> Engine:
        """Rank 0's engine of `--tp N` on the CPU: every card's receipt logged (one block a card, then
        the total), this card's arena, KV view and expert tiers (engine/tp_memory.py); each step
        carries its KV page changes to the other cards. No decode graphs are captured (nor may be,
        when CUDA is lifted): a replay would skip the step's send to the other ranks, which would
        wait for it forever."""
        refuse_device(cfg, device)
        ops.select(device, deterministic=cfg.deterministic)
        cards = plan_ranks(rad, cfg)
        for line in cards.lines():
            log.info(line)
        memory = rank_memory(rad, cfg, group, device, cards)
        receipt = memory.receipt
        engine = cls.assemble(rad, cfg, memory.kv_storage, memory.allocator(), device, memory.experts,
                              receipt.max_model_len, sampler_seed, group)
        engine.receipt, engine.arena, engine.cards, engine.experts = receipt, memory.arena, cards, memory.experts
        engine.runner.workers.arena = memory.arena
        engine.resources[:0] = memory.resources  # closed after the step broadcast: the other ranks stop first
        if any(r.experts_disk for r in cards.receipts) and engine.pipelined:
            engine.pipelined = False  # as on one card: a disk tier's host sync per layer leaves nothing to overlap
        return engine

    @classmethod
    def assemble(cls, rad: RadFile, cfg: Config, kv_storage: torch.Tensor, allocator: BlockAllocator,
                 device: torch.device | str = "cpu", experts=None, max_model_len: int | None = None,
                 sampler_seed: int | None = None, group: Group = SINGLE) -> Engine:
        """Wire the model, caches, scheduler and runner over given KV storage ([P, N, L, 2, S, Hkv, D], or
        uint8 [P, N, block bytes] for a quantized `cfg.kv_cache_dtype`) and its block allocator (tests
        give small pools). Over a `group` of `--tp` ranks this is rank 0's: its share of the model
        (Hkv its KV heads), every step sent to the other ranks (engine/tp_workers.py)."""
        cuda = torch.device(device).type == "cuda"
        mtp = _drafts_with_mtp(cfg, rad.model.num_mtp_layers)
        if group.size > 1:  # its share, the MTP head's included where it drafts
            model = load_shard(rad, group, device, experts=experts, mtp=mtp)
        else:
            model = load_model(rad, device, experts=experts, embedding_placement=cfg.embedding_table, mtp=mtp)
        m = model.cfg  # the card's heads under --tp
        if cuda:
            log.info(f"weights loaded: {model.placed.device_bytes / MiB:.2f} MiB on the card, "
                     f"{model.placed.host_bytes / MiB:.2f} MiB pinned in host RAM")
        hybrid = bool(m.linear_attention_layers)
        dtype = kv_storage.dtype if cfg.kv_cache_dtype == "auto" else activation_dtype(rad)
        states = RecurrentState.allocate(m, cfg.max_num_seqs, dtype, device, cfg.speculative) if hybrid else None
        # each decoding sequence keeps one checkpoint of its own; as many again stay cached for prefix hits
        n_checkpoints = 2 * cfg.max_num_seqs
        checkpoints = RecurrentState.allocate(m, n_checkpoints, dtype, device) if hybrid else None
        prefix = PrefixCache(allocator, hybrid, CheckpointSlots(n_checkpoints) if hybrid else None)
        scheduler = Scheduler(allocator=allocator, max_num_seqs=cfg.max_num_seqs,
                              max_num_batched_tokens=cfg.max_num_batched_tokens, max_queue=cfg.max_queue,
                              prefix=prefix, hybrid=hybrid, max_model_len=max_model_len)
        if cfg.speculative:
            scheduler.drafting = DraftPlanner(_draft_policy(cfg, mtp, torch.device(device)), allocator, max_model_len,
                                              BLOCK_TOKENS if hybrid else None,
                                              lookahead=cfg.speculative - 1 if mtp else 0)  # the chain's last at p+N-1
        tokenizer = Tokenizer.from_header(rad.header)
        kv_layers = m.full_attention_layers + ((m.num_hidden_layers,) if mtp else ())  # the MTP layer's KV: one more
        cache = KVCache(kv_storage, kv_layers, states, kv_format(cfg.kv_cache_dtype),
                        (BLOCK_TOKENS, m.num_key_value_heads, m.head_dim))
        runner = Runner(model, cache, checkpoints,
                        Sampler(device, sampler_seed), experts if isinstance(experts, ExpertSlab) else None)
        if mtp:
            runner.mtp_drafts = cfg.speculative  # chained drafts per sequence and step
        resources = []
        if group.size > 1:
            runner.workers = StepBroadcast()
            resources.append(runner.workers)  # closing the engine ends the other ranks' loops
        return cls(scheduler, runner, tokenizer, resources=resources, pipelined=not cfg.sequential_steps)


def _drafts_with_mtp(cfg: Config, num_mtp_layers: int) -> bool:
    """Whether the MTP head drafts; ConfigError for `--speculative-method mtp` on a model without one."""
    if cfg.speculative and cfg.speculative_method == "mtp" and not num_mtp_layers:
        raise ConfigError("--speculative-method mtp: this model has no MTP layers; use ngram (or auto)")
    return cfg.drafts_with_mtp(num_mtp_layers)


def _draft_policy(cfg: Config, mtp: bool, device: torch.device) -> DraftPolicy:
    """Speculative decoding's policy for --speculative N (n-gram or MTP drafts)."""
    what = f"up to {cfg.speculative} {'MTP' if mtp else 'n-gram'} drafts"
    log.info("speculative decoding: %s per sequence and step, adaptive (cost model r = %g on %s until measured "
             "before ready)", what, TOKEN_COST[device.type], device.type)
    return DraftPolicy(cfg.speculative, TOKEN_COST[device.type], propose=mtp_drafts if mtp else ngram_drafts)


def _step_graphs(engine: Engine, cfg: Config, receipt: Receipt, cuda: bool) -> StepGraphs | None:
    """Capture the step graphs (engine/graphs.py), or None where every step runs eagerly (said in the
    log, as the receipt's graph-pool line says it). A model with recurrent layers gets decode graphs, and
    mixed graphs for its verify steps only (graph_shapes.py says why)."""
    runner, m = engine.runner, engine.runner.model.cfg
    none = no_graphs(cuda, cfg.enforce_eager, cfg.drafts_with_mtp(m.num_mtp_layers), bool(receipt.experts_disk))
    if none is not None:
        if cuda:
            log.info("step graphs: none, every step runs eagerly: %s", none)
        return None
    max_blocks = -(-receipt.max_model_len // BLOCK_TOKENS)
    mixed = mixed_buckets_of(bool(m.linear_attention_layers), cfg.max_num_seqs, cfg.max_num_batched_tokens,
                             cfg.decode_tokens)
    return StepGraphs(runner.model, runner.cache, cfg.max_num_seqs, max_blocks, engine.experts, mixed=mixed,
                      decode_tokens=cfg.decode_tokens)
