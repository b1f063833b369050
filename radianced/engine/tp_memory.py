"""One rank's memory under `--tp N`: its card's receipt (tp_plan.py plans every card, each for its
own share), the arena that receipt describes, the KV cache as a view over its pages, and the
card's expert tiers over its own routed experts (sharding's `experts` range): slots in its arena,
its own host pool and reads of the file, built by the one-card code (tiers/build.py) from its
receipt. Each card resolves its own misses inside the step (overflow reads, the disk tier); rank 0
never needs to know where another card's experts live.

Every rank plans all the cards (pure, the same on every rank) and keeps its own receipt, so rank 0
prints the blocks of every card without asking the others. Rank 0's allocator decides every
rank's blocks (engine/tp_workers.py), so a block id it leases must index a page that every card
gives to KV: the other cards follow rank 0's KV tenant page for page (`RankMemory.follow`: rank
0's arena records its KV leases and releases, each step carries them), giving up a cached expert
slot where rank 0's KV takes its page. Pinned experts are never given up: each card's take the
arena's first pages, which rank 0's KV never reaches while no card pins more than card 0 (card 0
owns the most experts: split_range gives the remainder to the first); and no other card may have
fewer arena pages than card 0 (card 0 has the least room on equal cards: it holds the remainder
of every split and gathers the logits). The total's KV pool is the least card's for the same
reason (tp_plan.py).

A quantized KV cache (`--kv-cache-dtype`) is quantized on each card as on one: its scales are per
(block, KV head), and a card holds whole heads, so each card's blocks are one card's blocks of its
heads (the card's receipt sizes them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radianced.arena import EXPERTS, KV, Arena, Lease, PageChange, TenantPages
from radianced.budget import PlanError
from radianced.card import Card, detect_card
from radianced.config import Config, ConfigError
from radianced.kv.blocks import BlockAllocator
from radianced.kv.reclaimer import KVReclaimer
from radianced.model.loader import activation_dtype
from radianced.model.parallel import Group
from radianced.model.rad import RadFile
from radianced.receipt import Receipt
from radianced.sharding import card_config
from radianced.sizing import BLOCK_TOKENS, ModelFacts
from radianced.tiers.build import build_expert_slab
from radianced.tiers.slab import ExpertSlab
from radianced.tp_plan import CardsReceipt, plan_cards, rank_cards


@dataclass
class RankMemory:
    """A rank's card, allocated as its receipt says.

    cards: every card's receipt and their total (the same on every rank).
    rank: this card's.
    arena: this card's arena (its receipt's elastic line).
    kv_storage: the KV cache over the arena's pages, [P, N, L, 2, S, Hkv, D] for this card's KV heads
        (uint8 [P, N, block bytes] for a quantized `--kv-cache-dtype`, as on one card).
    experts: this card's expert tiers (its slots, host pool and reads), or None for a dense model.
    resources: what `close` gives back (the host pool, the expert loader).
    """

    cards: CardsReceipt
    rank: int
    arena: Arena
    kv_storage: torch.Tensor
    experts: ExpertSlab | None
    resources: list = field(default_factory=list)

    @property
    def receipt(self) -> Receipt:
        return self.cards.receipts[self.rank]

    def allocator(self) -> BlockAllocator:
        """Rank 0's block allocator: the KV tenant's pages of this arena, leased block by block (in
        lending mode taking cached expert slots back, as on one card). The arena records the KV
        tenant's leases and releases from here, for the other cards to `follow`."""
        kv = self.receipt.groups[0]
        allocator = BlockAllocator(BLOCK_TOKENS, TenantPages(self.arena, KV), {kv.name: self.receipt.blocks_per_page(kv)})
        if self.receipt.mode == "lending":
            self.arena.register(KV, KVReclaimer(allocator))
        self.arena.record(KV)
        return allocator

    def follow(self, changes: list[PageChange]) -> None:
        """Make rank 0's KV leases and releases (`Arena.changes`) on this card's arena, in order (a
        card beyond the first, before the step that planned them): a cached expert slot on a page
        KV takes is given up first (its expert reads from its home until a rebalance)."""
        for leased, pages in changes:
            if not leased:
                self.arena.release(Lease(KV, pages))
                continue
            slotted = [p for p in pages if self.arena.owner(p) == EXPERTS]
            if slotted:
                self.arena.release(self.experts.give_up(slotted))
            self.arena.take(KV, pages)

    def close(self) -> None:
        """Give back the host pool and the expert loader (as `Engine.close` does on one card)."""
        while self.resources:
            self.resources.pop().close()


def refuse_device(cfg: Config, device: torch.device | str) -> None:
    """ConfigError for `--tp N` off the CPU, the one backend it has run on."""
    if cfg.tp > 1 and torch.device(device).type != "cpu":
        raise ConfigError(f"--tp {cfg.tp}: not yet supported on {device}: NCCL across cards has not run on a "
                          "machine of several GPUs yet; serve with --tp 1, or on the CPU")


def cpu_cards(cfg: Config) -> tuple[Card, ...]:
    """The `--tp` cards of the CPU backend: `--card-mib` each, else each rank's share of the CPU card
    (half of RAM, tp_plan.rank_cards: N ranks share one machine's RAM)."""
    if cfg.card_mib:
        return (Card.from_mib(cfg.card_mib, cuda=False),) * cfg.tp
    return rank_cards(detect_card("cpu"), cfg.tp)


def plan_ranks(rad: RadFile, cfg: Config) -> CardsReceipt:
    """Every card's receipt; PlanError for a split this build cannot serve (the module says which)."""
    cards = plan_cards(cpu_cards(cfg), ModelFacts.from_header(rad.header), cfg)
    first = cards.receipts[0]
    for rank, r in enumerate(cards.receipts[1:], 1):
        if r.arena_pages < first.arena_pages:
            raise PlanError(f"--tp {cfg.tp}: card {rank} has {r.arena_pages} arena pages, fewer than card 0's "
                            f"{first.arena_pages}, whose block ids every card shares; give the cards equal room")
        if r.experts_pinned > first.experts_pinned:
            raise PlanError(f"--tp {cfg.tp}: card {rank} pins {r.experts_pinned} experts, more than card 0's "
                            f"{first.experts_pinned}, on arena pages card 0 may give to KV; give each card the "
                            f"room to pin the same (--expert-slots {first.experts_pinned}, or more --host-pool-mib "
                            "so that fewer experts are pinned), or serve with --tp 1")
    return cards


def rank_memory(rad: RadFile, cfg: Config, group: Group, device: torch.device | str = "cpu",
                cards: CardsReceipt | None = None) -> RankMemory:
    """Allocate this rank's card as its receipt among `cards` (default: `plan_ranks`) says: its arena,
    its expert tiers (slots filled, host pool filled and checked) and the KV view."""
    cards = cards or plan_ranks(rad, cfg)
    share, receipt = cards.shares[group.rank], cards.receipts[group.rank]
    arena = Arena.from_receipt(receipt, device)
    dtype, resources = activation_dtype(rad), []
    experts = None
    if rad.header.experts:
        experts = build_expert_slab(rad, arena, receipt, dtype, cfg, resources, owned=share.experts)
    m = card_config(rad.model, share)
    kv = receipt.groups[0]
    if cfg.kv_cache_dtype == "auto":
        storage = arena.paged_view(dtype, (receipt.blocks_per_page(kv), kv.layers, 2, BLOCK_TOKENS,
                                           m.num_key_value_heads, m.head_dim))
    else:  # quantized blocks: codes and scales of all layers, the receipt's block_bytes each
        storage = arena.paged_view(torch.uint8, (receipt.blocks_per_page(kv), kv.block_bytes))
    return RankMemory(cards, group.rank, arena, storage, experts, resources)
