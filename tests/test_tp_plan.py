"""The split of --tp N cards: one receipt a card, planned for its own share, and their total;
`radiancectl plan --tp N`; the daemon takes it. Expected numbers are the arithmetic."""

from __future__ import annotations

from types import SimpleNamespace

import psutil
import pytest
import torch

from radianced import ctl
from radianced.budget import PlanError, plan
from radianced.card import Card
from radianced.config import Config, parse_config
from radianced.model.convert import convert
from radianced.model.rad import RadFile
from radianced.model.tiny import make_tiny
from radianced.sharding import shard_facts
from radianced.sizing import BLOCK_TOKENS, ModelFacts, kv_pages, kv_token_bytes
from radianced.tp_plan import detect_cards, plan_cards, rank_cards
from tests.test_budget import QWEN3_30B, QWEN3_NEXT, SMOLLM2, TINY_LLAMA, TINY_MOE, TINY_NEXT

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def planning(text: str) -> Config:
    return parse_config(text.split())


@pytest.mark.parametrize("model, flags", [
    (SMOLLM2, "--card-mib 8192"), (QWEN3_30B, "--card-mib 24576 --host-pool-mib 8192 --weights-disk-tier"),
    (QWEN3_NEXT, "--card-mib 81920 --max-model-len 65536 --speculative 2 --weights-disk-tier"),
    (TINY_MOE, "--card-mib 512 --deterministic"), (TINY_NEXT, "--card-mib 512 --placement resident"),
    (TINY_LLAMA, "--card-mib 512 --embedding-placement vram"),
])
def test_one_card_is_todays_plan_exactly(model, flags):
    cfg, facts = planning(flags), ModelFacts.from_config(model, 2)
    card = Card.from_mib(cfg.card_mib, cuda=True)
    assert plan_cards((card,), facts, cfg).receipts == (plan(card, facts, cfg),)


def test_qwen3_30b_over_two_equal_cards():
    cfg = planning("--tp 2 --card-mib 24576 --host-pool-mib 8192 --max-model-len 32768 --max-num-seqs 4")
    whole = ModelFacts.from_config(QWEN3_30B, 2)
    r = plan_cards(detect_cards(cfg), whole, cfg)
    norms = (48 * (2 * 2048 + 2 * 128) + 2048) * 2  # two per layer, q/k norms, the final norm: whole on each card
    for card in r.receipts:
        # lm_head: half the vocab rows; attention: 16 query + 2 KV heads of 128 dims in 48 layers; norms and
        # router whole; the embedding rows (half) pinned in host RAM
        assert card.weights_bytes == 75968 * 2048 * 2 + 48 * (2 * 2048 * 16 * 128 + 2 * 2048 * 2 * 128) * 2 \
            + norms + 48 * 128 * 2048 * 2
        assert card.host_weights[0].bytes == 75968 * 2048 * 2
        assert card.experts == 48 * 64 and card.experts_pinned + card.experts_host + card.experts_disk == 48 * 64
        assert card.host_pool == 8192 * MiB  # each card's own host pool
        assert kv_token_bytes(card.groups) == 48 * 2 * 2 * 128 * 2 == 48 * KiB  # half of one card's 96 KiB
        # the pool's tokens are what its KV pages hold at the card's own bytes per token
        assert kv_pages(card.groups, card.page_bytes, card.kv_pool_tokens) <= card.kv_max_pages \
            < kv_pages(card.groups, card.page_bytes, card.kv_pool_tokens + BLOCK_TOKENS)
    c0, c1 = r.receipts
    assert c0.workspace[0].bytes == 4 * 151936 * (2 + 20)  # card 0 gathers every card's logits and samples
    assert c1.workspace[0].bytes == 4 * 75968 * 2  # its lm_head rows' output only
    assert c0.experts_host == c1.experts_host == 8192 * MiB // (9 * MiB)  # 9 MiB slots
    assert r.weights_bytes == c0.weights_bytes + c1.weights_bytes
    assert r.kv_pool_tokens == min(c0.kv_pool_tokens, c1.kv_pool_tokens)
    assert r.full_sessions == min(c0.full_sessions, c1.full_sessions)


def test_the_receipt_prints_a_block_a_card_then_the_total():
    cfg = planning("--tp 2 --card-mib 24576 --host-pool-mib 8192 --max-model-len 32768 --max-num-seqs 4")
    r = plan_cards(detect_cards(cfg), ModelFacts.from_config(QWEN3_30B, 2), cfg)
    lines = r.lines()
    n = len(r.receipts[0].lines())
    assert lines[0] == "card 0: query heads 0-15, KV heads 0-1, vocab rows 0-75967, experts 0-63"
    assert lines[1:1 + n] == ["  " + line for line in r.receipts[0].lines()]
    assert lines[1 + n] == "card 1: query heads 16-31, KV heads 2-3, vocab rows 75968-151935, experts 64-127"
    c0, c1 = r.receipts
    pinned, host = c0.experts_pinned + c1.experts_pinned, c0.experts_host + c1.experts_host
    assert lines[2 + 2 * n:] == [
        "total over 2 cards:",
        "  cards: 49152.00 MiB total, 49152.00 MiB free",
        f"  weights on cards: {2 * c0.weights_bytes / MiB:.2f} MiB ({c0.weights_bytes / MiB:.2f} MiB, "
        f"{c1.weights_bytes / MiB:.2f} MiB)",
        f"  host RAM pinned: {2 * (75968 * 2048 * 2 + 4 * 9 * MiB) / MiB:.2f} MiB",  # embedding rows, staging
        f"  experts: 6144 routed (54.00 GiB), each on one card: {pinned} pinned on cards, {host} in host pools, "
        f"0 on disk",
        f"  expert slots: {c0.expert_slots + c1.expert_slots} at start ({c0.expert_slots}, {c1.expert_slots})",
        "  kv per token: 96.00 KiB over the cards (48.00 KiB, 48.00 KiB)",
        f"  kv pool: {r.kv_pool_tokens} tokens, the least card's (every card holds every sequence's KV for its heads)",
        f"  kv: the pools back {r.worst_case_percent}% of the worst case (4 seqs x 32768 tokens) = "
        f"{r.full_sessions} full-length session{'' if r.full_sessions == 1 else 's'}",
    ]


def test_each_card_charges_its_share_of_the_mtp_head_and_pages_its_kv_as_one_more_layer():
    """--speculative 2 on Qwen3-Next over two cards (auto: the MTP head, under --tp too): each card's receipt
    loads its half of the head (tests/test_sharding.py has its bytes by hand), none idle, and its KV pool
    pages the head's layer with its 12 full-attention layers, at its one KV head."""
    cfg = planning("--tp 2 --card-mib 81920 --max-model-len 65536 --speculative 2 --weights-disk-tier")
    whole = ModelFacts.from_config(QWEN3_NEXT, 2)
    r = plan_cards(detect_cards(cfg), whole, cfg)
    for rank, card in enumerate(r.receipts):
        assert {p.name: p.bytes for p in card.weights}["mtp"] == shard_facts(whole, rank, 2).weight("mtp")
        assert not card.idle_weights
        assert [(g.layers, g.mtp) for g in card.groups] == [(12 + 1, True)]
        assert card.groups[0].token_bytes == 13 * 2 * 1 * 256 * 2  # K and V of one KV head of 256, bf16


def test_each_cpu_rank_plans_its_own_share_of_ram(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=8 * GiB + 6, available=3 * GiB + 1))
    cards = detect_cards(planning("--tp 2"))  # the CPU card: half of RAM (4 GiB + 3), 3 GiB + 1 of it free
    assert cards == (Card(2 * GiB + 1, 3 * GiB // 2, False), Card(2 * GiB + 2, 3 * GiB // 2 + 1, False))
    assert rank_cards(Card(10, 10), 3) == (Card(3, 3), Card(3, 3), Card(4, 4))
    r = plan_cards(cards, ModelFacts.from_config(TINY_NEXT, 4), planning("--tp 2"))
    assert [c.card_total for c in r.receipts] == [2 * GiB + 1, 2 * GiB + 2]


def test_card_mib_is_each_card():
    assert detect_cards(planning("--tp 3 --card-mib 1024")) == (Card.from_mib(1024, cuda=True),) * 3


def test_a_card_that_cannot_hold_its_share_is_named():
    cfg = planning("--tp 2 --card-mib 1")
    with pytest.raises(PlanError, match=r"^card 0 of 2: the card is \d+\.\d\d MiB short: "):
        plan_cards(detect_cards(cfg), ModelFacts.from_config(TINY_MOE, 4), cfg)


def test_more_cards_than_query_heads_are_refused():
    cfg = Config(tp=5, card_mib=64)
    with pytest.raises(PlanError, match=r"^--tp 5: the model has 4 query heads, and every card needs one: "
                                        r"give at most --tp 4$"):
        plan_cards(detect_cards(cfg), ModelFacts.from_config(TINY_MOE, 4), cfg)


@pytest.fixture(scope="module")
def tiny_moe_rad(tmp_path_factory):
    src = make_tiny("qwen3_moe", tmp_path_factory.mktemp("tiny-moe"))
    convert(src, src / "model.rad")
    return src / "model.rad"


def test_radiancectl_plan_tp_2_prints_each_card_and_the_total(tiny_moe_rad, capsys):
    assert ctl.main(["plan", "--model", str(tiny_moe_rad), "--card-mib", "256", "--tp", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    with RadFile.open(tiny_moe_rad) as rad:
        facts = ModelFacts.from_header(rad.header)
    cfg = planning(f"--model {tiny_moe_rad} --card-mib 256 --tp 2")
    assert out == plan_cards((Card.from_mib(256, cuda=True),) * 2, facts, cfg).lines()
    assert out[0] == "card 0: query heads 0-1, KV heads 0-0, vocab rows 0-199, experts 0-3"
    assert "card 1: query heads 2-3, KV heads 1-1, vocab rows 200-399, experts 4-7" in out
    assert "  experts: 24 routed (0.00 GiB), each on one card: 24 pinned on cards, 0 in host pools, 0 on disk" in out


def test_radiancectl_plan_says_why_it_cannot_split(tiny_moe_rad, capsys):
    assert ctl.main(["plan", "--model", str(tiny_moe_rad), "--card-mib", "256", "--tp", "8"]) == 1
    assert capsys.readouterr().err == ("radiancectl plan: error: --tp 8: the model has 4 query heads, and every "
                                       "card needs one: give at most --tp 4\n")


def test_the_daemon_takes_several_cards():
    assert parse_config(["--tp", "2"]).tp == 2  # served on the CPU (tests/server/test_daemon_tp.py)
