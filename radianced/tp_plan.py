"""The split of `--tp N` cards: each card planned for its own share of the model (sharding.py says
which), one receipt a card and their total (`CardsReceipt`). Pure, but for `detect_cards`, which asks
torch as `card.detect_card` does.

Flags that size a card apply to each card: --gpu-memory-mib, --gpu-headroom-mib, --card-mib (N
cards of that size), --expert-slots, and --host-pool-mib (a card's host pool holds only its own
experts, read over its own link: the host pins N times it); every card runs every step's tokens, so
--max-num-seqs and --max-num-batched-tokens size each card's workspace and block tables. A sequence's
KV is on every card (each holds its KV heads), so the cards together hold the tokens the fullest
card holds: the total's KV pool is the least of the cards'.

On the CPU backend the card is half of RAM (`card.detect_card`), and each gloo rank plans its own
share of that half (`rank_cards`), not the half each: N ranks in one machine's RAM.
"""

from __future__ import annotations

from dataclasses import dataclass

from radianced.budget import PlanError, plan
from radianced.card import Card, detect_card
from radianced.config import Config
from radianced.receipt import Receipt, fmt_gib, fmt_kib, fmt_mib
from radianced.sharding import CardShare, SplitError, most_cards, shard_facts, share_bytes
from radianced.sizing import ModelFacts, kv_token_bytes


@dataclass(frozen=True)
class CardsReceipt:
    """The split of every card of `--tp N`, by rank; the totals are properties.

    shares: each card's share of the model (`sharding.CardShare`).
    receipts: each card's split: `budget.plan` of its share (`sharding.shard_facts`) on its card.
    """

    shares: tuple[CardShare, ...]
    receipts: tuple[Receipt, ...]

    @property
    def weights_bytes(self) -> int:
        return sum(r.weights_bytes for r in self.receipts)

    @property
    def host_bytes(self) -> int:
        """Pinned host RAM of every card: embedding rows kept there and the expert read staging."""
        return sum(p.bytes for r in self.receipts for p in r.host_weights)

    @property
    def kv_pool_tokens(self) -> int:
        return min(r.kv_pool_tokens for r in self.receipts)

    @property
    def full_sessions(self) -> int:
        return min(r.full_sessions for r in self.receipts)

    @property
    def worst_case_percent(self) -> int:
        return min(r.worst_case_percent for r in self.receipts)

    def lines(self) -> list[str]:
        """One block a card ("card 0: ...", its receipt indented), then the total."""
        out = []
        for share, r in zip(self.shares, self.receipts):
            out.append(f"card {share.rank}: {share.words()}")
            out += ["  " + line for line in r.lines()]
        return out + self._total_lines()

    def _total_lines(self) -> list[str]:
        rs, n = self.receipts, len(self.receipts)
        first = rs[0]
        out = [f"total over {n} cards:",
               f"  cards: {fmt_mib(sum(r.card_total for r in rs))} total, {fmt_mib(sum(r.card_free for r in rs))} free",
               f"  weights on cards: {fmt_mib(self.weights_bytes)} "
               f"({', '.join(fmt_mib(r.weights_bytes) for r in rs)})",
               f"  host RAM pinned: {fmt_mib(self.host_bytes)}"]
        if first.experts:
            experts = sum(r.experts for r in rs)
            out += [f"  experts: {experts} routed ({fmt_gib(sum(r.experts * r.expert_extent for r in rs))}), "
                    f"each on one card: {sum(r.experts_pinned for r in rs)} pinned on cards, "
                    f"{sum(r.experts_host for r in rs)} in host pools, {sum(r.experts_disk for r in rs)} on disk",
                    f"  expert slots: {sum(r.expert_slots for r in rs)} at start "
                    f"({', '.join(str(r.expert_slots) for r in rs)})"]
        out += [f"  kv per token: {fmt_kib(sum(kv_token_bytes(r.groups) for r in rs))} over the cards "
                f"({', '.join(fmt_kib(kv_token_bytes(r.groups)) for r in rs)})",
                f"  kv pool: {self.kv_pool_tokens} tokens, the least card's (every card holds every "
                f"sequence's KV for its heads)",
                f"  kv: the pools back {self.worst_case_percent}% of the worst case ({first.max_num_seqs} seqs x "
                f"{first.max_model_len} tokens) = {self.full_sessions} full-length "
                f"session{'' if self.full_sessions == 1 else 's'}"]
        return out


def plan_cards(cards: tuple[Card, ...], facts: ModelFacts, cfg: Config) -> CardsReceipt:
    """Split each of the `cfg.tp` `cards` for its share of `facts`. Pure.

    Raises PlanError when the model has fewer heads or experts than cards, when the split would cut
    the blocks of a compact tensor (sharding.card_shape), or when a card's split does not work (the
    message names the card and what would work there).
    """
    tp = cfg.tp
    if len(cards) != tp:
        raise ValueError(f"{len(cards)} cards for --tp {tp}")
    most, units = most_cards(facts.model)
    if tp > most:
        raise PlanError(f"--tp {tp}: the model has {most} {units}, and every card needs one: give at most --tp {most}")
    try:
        shards = [shard_facts(facts, rank, tp) for rank in range(tp)]
    except SplitError as e:  # a compact tensor whose split would cut its blocks
        raise PlanError(str(e)) from None
    receipts = []
    for rank, (card, card_facts) in enumerate(zip(cards, shards)):
        try:
            receipts.append(plan(card, card_facts, cfg))
        except PlanError as e:
            raise PlanError(f"card {rank} of {tp}: {e}") from None
    return CardsReceipt(tuple(f.share for f in shards), tuple(receipts))


def rank_cards(card: Card, tp: int) -> tuple[Card, ...]:
    """`card` (the CPU backend's) divided among `tp` ranks, the remainder to the first."""
    def share(n: int, rank: int) -> int:
        return share_bytes(n, tp, (rank, rank + 1))

    return tuple(Card(share(card.total_bytes, r), min(share(card.free_bytes, r), share(card.total_bytes, r)), card.cuda)
                 for r in range(tp))


def detect_cards(cfg: Config) -> tuple[Card, ...]:
    """The `--tp` cards to plan: `--card-mib` empty GPUs of that size; else this machine's first
    `--tp` GPUs, or on the CPU backend each rank's share of the CPU card. Raises PlanError when the
    machine has fewer GPUs than `--tp`."""
    tp = cfg.tp
    if cfg.card_mib:  # --card-mib describes a GPU: its arena is allocated in the CUDA allocator's units
        return (Card.from_mib(cfg.card_mib, cuda=True),) * tp
    import torch

    if not torch.cuda.is_available():
        return rank_cards(detect_card("cpu"), tp)
    gpus = torch.cuda.device_count()
    if gpus < tp:
        raise PlanError(f"--tp {tp}: this machine has {gpus} GPU{'' if gpus == 1 else 's'}: give --tp {gpus}, "
                        f"or --card-mib N to plan {tp} cards of N MiB each")
    return tuple(detect_card(f"cuda:{i}") for i in range(tp))
