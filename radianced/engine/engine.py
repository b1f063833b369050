"""One served model: the scheduler plans a step, the runner executes it.

`Engine.step()` is the whole loop body; `AsyncEngine` (engine/driver.py) runs
it with the runner on a worker thread and the bookkeeping on the event loop.
`Engine.build` derives every pool from the budget receipt: the arena is the
receipt's elastic line, and the KV cache is a view over its pages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from radianced.arena import EXPERTS, KV, Arena, TenantPages, detect_card
from radianced.budget import BLOCK_TOKENS, Card, ModelFacts, PlanError, Receipt, plan
from radianced.config import Config
from radianced.engine.request import Request
from radianced.engine.runner import Runner
from radianced.engine.sampler import Sampler
from radianced.engine.scheduler import Scheduler, SeqEvent
from radianced.kv.blocks import BlockAllocator
from radianced.kv.prefix import PrefixCache
from radianced.kv.state import CheckpointSlots
from radianced.model.batch import KVCache, RecurrentState
from radianced.model.experts import ResidentExperts
from radianced.model.loader import load_model
from radianced.model.rad import RadFile
from radianced.model.tokenizer import Tokenizer

log = logging.getLogger("radianced.engine")


@dataclass
class Engine:
    scheduler: Scheduler
    runner: Runner
    tokenizer: Tokenizer
    receipt: Receipt | None = None
    arena: Arena | None = None

    def step(self) -> list[SeqEvent]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        return self.scheduler.update(plan, self.runner.run(plan))

    def add(self, request: Request):
        """Queue a request (raises QueueFull); returns its scheduler sequence (read-only for callers)."""
        return self.scheduler.add(request)

    @classmethod
    def build(cls, rad: RadFile, cfg: Config, card: Card | None = None, device: torch.device | str = "cpu",
              sampler_seed: int | None = None) -> Engine:
        """Plan the card, log the receipt, allocate the arena it describes and load the model.

        The KV cache is a view over the arena's pages (the KV tenant leases them
        block by block). Routed experts are copied into arena pages leased to the
        expert tenant, which holds as many slots as there are experts until the
        expert tiers land: a plan that does not give every expert a slot is refused.
        """
        m = rad.model
        receipt = plan(card or detect_card(device), ModelFacts.from_header(rad.header), cfg)
        for line in receipt.lines():
            log.info(line)
        arena = Arena.from_receipt(receipt, device)
        dtype = rad.tensor("model.embed_tokens.weight", verify=False).dtype
        experts = None
        if rad.header.experts:
            experts = _experts_in_arena(rad, arena, receipt, dtype)
        group = receipt.groups[0]
        bpp = receipt.blocks_per_page(group)
        storage = arena.paged_view(dtype, (bpp, group.layers, 2, BLOCK_TOKENS, m.num_key_value_heads, m.head_dim))
        allocator = BlockAllocator(BLOCK_TOKENS, TenantPages(arena, KV), {group.name: bpp})
        engine = cls.assemble(rad, cfg, storage, allocator, device, experts, receipt.max_model_len, sampler_seed)
        engine.receipt, engine.arena = receipt, arena
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
                        Sampler(device, sampler_seed), tokenizer.eos_token_ids)
        return cls(scheduler, runner, tokenizer)

def _experts_in_arena(rad: RadFile, arena: Arena, receipt: Receipt, dtype: torch.dtype) -> ResidentExperts:
    """Every routed expert in its own arena page (one slot each); the table holds page ids."""
    count = receipt.experts
    if receipt.expert_slots < count:
        raise PlanError(f"the plan gives {receipt.expert_slots} expert slots for {count} experts; until the "
                        f"expert tiers (host pool, disk) land every expert needs a slot: give a larger card "
                        f"(--card-mib / --gpu-headroom-mib) or a smaller --max-model-len")
    pages = arena.lease(EXPERTS, count).pages
    width = receipt.expert_extent // dtype.itemsize
    return ResidentExperts.from_rad(rad, slab=arena.paged_view(dtype, (width,)), rows=list(pages))
