"""One rank's memory under `--tp N`: its card's receipt (tp_plan.py plans every card, each for its
own share), the arena that receipt describes, the KV cache as a view over its pages, and the
card's routed experts (sharding's `owned_experts`) pinned in arena pages.

Every rank plans all the cards (pure, the same on every rank) and keeps its own receipt, so rank 0
prints the blocks of every card without asking the others. Rank 0's allocator decides every
rank's blocks (engine/tp_workers.py), so a block id it leases must index a page the other cards
hold and do not use for experts: the experts of each card take the arena's first pages (card 0
owns the most experts: split_range gives the remainder to the first), and no other card may have
fewer arena pages than card 0 (card 0 has the least room on equal cards: it holds the remainder
of every split and gathers the logits). The total's KV pool is the least card's for the same
reason (tp_plan.py).

Not built yet, refused with a message: the expert tiers per card (a host pool and overflow reads
over each card's link, the disk tier), and a quantized KV cache under `--tp`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radianced.arena import EXPERTS, KV, Arena, TenantPages
from radianced.budget import PlanError
from radianced.card import Card, detect_card
from radianced.config import Config, ConfigError
from radianced.kv.blocks import BlockAllocator
from radianced.model.experts import ResidentExperts
from radianced.model.loader import activation_dtype
from radianced.model.parallel import Group
from radianced.model.rad import RadFile
from radianced.model.sharded_loader import owned_experts
from radianced.receipt import Receipt
from radianced.sharding import card_config
from radianced.sizing import BLOCK_TOKENS, ModelFacts
from radianced.tp_plan import CardsReceipt, plan_cards, rank_cards


@dataclass(frozen=True)
class RankMemory:
    """A rank's card, allocated as its receipt says.

    cards: every card's receipt and their total (the same on every rank).
    rank: this card's.
    arena: this card's arena (its receipt's elastic line).
    kv_storage: the KV cache over the arena's pages, [P, N, L, 2, S, Hkv, D] for this card's KV heads.
    experts: this card's routed experts in arena pages, or None for a dense model.
    """

    cards: CardsReceipt
    rank: int
    arena: Arena
    kv_storage: torch.Tensor
    experts: ResidentExperts | None

    @property
    def receipt(self) -> Receipt:
        return self.cards.receipts[self.rank]

    def allocator(self) -> BlockAllocator:
        """Rank 0's block allocator: the KV tenant's pages of this arena, leased block by block."""
        kv = self.receipt.groups[0]
        return BlockAllocator(BLOCK_TOKENS, TenantPages(self.arena, KV), {kv.name: self.receipt.blocks_per_page(kv)})


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
    """Every card's receipt; PlanError for a split this build cannot serve yet (the module says which)."""
    if cfg.kv_cache_dtype != "auto":
        raise ConfigError(f"--kv-cache-dtype {cfg.kv_cache_dtype} with --tp {cfg.tp}: not yet supported; "
                          "use auto, or --tp 1")
    cards = plan_cards(cpu_cards(cfg), ModelFacts.from_header(rad.header), cfg)
    for rank, r in enumerate(cards.receipts):
        if r.experts_host or r.experts_disk:
            raise PlanError(f"--tp {cfg.tp}: card {rank}'s receipt leaves {r.experts_host} experts in the host pool "
                            f"and {r.experts_disk} on disk; the expert tiers per card are not built yet: give each "
                            f"card room for its experts (--card-mib), or serve with --tp 1")
        if r.arena_pages < cards.receipts[0].arena_pages:
            raise PlanError(f"--tp {cfg.tp}: card {rank} has {r.arena_pages} arena pages, fewer than card 0's "
                            f"{cards.receipts[0].arena_pages}, whose block ids every card shares; give the cards "
                            "equal room")
    return cards


def rank_memory(rad: RadFile, cfg: Config, group: Group, device: torch.device | str = "cpu") -> RankMemory:
    """Plan every card, then allocate this rank's: its arena, the KV view and its experts' pages."""
    cards = plan_ranks(rad, cfg)
    receipt = cards.receipts[group.rank]
    arena = Arena.from_receipt(receipt, device)
    dtype = activation_dtype(rad)
    m = card_config(rad.model, cards.shares[group.rank])
    kv = receipt.groups[0]
    storage = arena.paged_view(dtype, (receipt.blocks_per_page(kv), kv.layers, 2, BLOCK_TOKENS,
                                       m.num_key_value_heads, m.head_dim))
    experts = _pinned_experts(rad, cards, group.rank, arena, dtype) if rad.header.experts else None
    return RankMemory(cards, group.rank, arena, storage, experts)


def _pinned_experts(rad: RadFile, cards: CardsReceipt, rank: int, arena: Arena,
                    dtype: torch.dtype) -> ResidentExperts:
    """The card's experts in the arena's first pages (the EXPERTS tenant's, never taken back: no
    reclaimer is registered for them), one an expert, as its receipt pins them."""
    share, receipt = cards.shares[rank], cards.receipts[rank]
    lease = arena.lease(EXPERTS, receipt.experts_pinned)
    first = lease.pages[0]
    if lease.pages != tuple(range(first, first + len(lease))):
        raise RuntimeError(f"card {rank}: the experts' pages are not contiguous: {lease.pages[:8]}")
    rows = arena.paged_view(dtype, (receipt.expert_extent // dtype.itemsize,))[first:first + len(lease)]
    return owned_experts(rad, share, out=rows)
