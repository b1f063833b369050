"""One arena, two tenants: KV takes expert slots when it needs pages and gives them back.

Tiny Qwen3-MoE with every expert's home in the host pool and an arena of 34
pages: 24 expert slots at start plus 10 KV pages. Four long requests need about
20 KV pages, so the arena takes cached expert slots back (down to the floor);
once they finish, the routing of later steps re-admits experts into the pages
KV no longer uses. Greedy tokens equal the all-resident engine's throughout.
"""

from __future__ import annotations

from radianced.arena import EXPERTS, KV
from radianced.budget import plan
from radianced.card import Card
from radianced.config import Config
from radianced.engine.engine import Engine
from radianced.sizing import ModelFacts
from tests.engine.conftest import prompts, request, run_all, small_engine

PAGES = 34


def lending_engine(rad) -> Engine:
    cfg = Config(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, host_pool_mib=1)
    facts = ModelFacts.from_header(rad.header)
    probe = plan(Card.from_mib(1024), facts, cfg)
    fixed = probe.card_total - probe.elastic  # everything but the elastic region
    size = fixed + PAGES * probe.page_bytes
    return Engine.build(rad, cfg, Card(size, size))


def test_pages_move_from_experts_to_kv_and_back_and_tokens_stay_the_same(tiny_rads):
    rad = tiny_rads["qwen3_moe"]
    engine = lending_engine(rad)
    arena, receipt = engine.arena, engine.receipt
    assert (receipt.mode, receipt.arena_pages, receipt.experts_host) == ("lending", PAGES, 24)
    assert arena.held(EXPERTS) == 24 and engine.experts.num_slots == 24

    long = prompts(rad.model.vocab_size, (100, 104, 108, 112), seed=31)
    for i, p in enumerate(long):
        engine.add(request(engine, f"l{i}", p, max_tokens=48, ignore_eos=True))
    got: dict[str, list[int]] = {}
    fewest_expert_pages = arena.held(EXPERTS)
    while engine.scheduler.has_unfinished:
        for ev in engine.step():
            got.setdefault(ev.request_id, []).extend(ev.token_ids)
        fewest_expert_pages = min(fewest_expert_pages, arena.held(EXPERTS))
    moved = dict(arena.stats().moved)
    assert moved.get((EXPERTS, KV), 0) > 0, "KV should have taken expert slots"
    assert fewest_expert_pages < 24 and fewest_expert_pages >= receipt.expert_floor
    assert engine.experts.stats.total_lookups > engine.experts.stats.total_hits  # some reads went over the link

    ref_engine = small_engine(rad, num_blocks=128)
    ref = run_all(ref_engine, [request(ref_engine, f"l{i}", p, max_tokens=48, ignore_eos=True)
                               for i, p in enumerate(long)])
    assert got == ref

    short = prompts(rad.model.vocab_size, (20, 24, 28), seed=32)
    after = run_all(engine, [request(engine, f"s{i}", p, max_tokens=24, ignore_eos=True) for i, p in enumerate(short)])
    assert dict(arena.stats().moved).get((KV, EXPERTS), 0) > 0, "hot experts should take pages back from KV"
    assert arena.held(EXPERTS) > fewest_expert_pages
    ref_engine = small_engine(rad)
    assert after == run_all(ref_engine, [request(ref_engine, f"s{i}", p, max_tokens=24, ignore_eos=True)
                                         for i, p in enumerate(short)])


def test_outputs_are_identical_whatever_the_placement(tiny_rads):
    """All experts pinned on the card, or 25% in slots with the rest read from the host pool."""
    rad = tiny_rads["qwen3_moe"]
    ps = prompts(rad.model.vocab_size, (9, 33, 50), seed=33)
    outs, slots = [], []
    for flags in (dict(), dict(host_pool_mib=1, expert_slots=6)):
        cfg = Config(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, **flags)
        engine = Engine.build(rad, cfg, Card.from_mib(256))
        slots.append(engine.experts.num_slots)
        outs.append(run_all(engine, [request(engine, f"p{i}", p, max_tokens=16) for i, p in enumerate(ps)]))
        assert engine.experts.num_slots == slots[-1]  # --expert-slots caps refills too
        if flags:
            stats = engine.experts.stats
            assert stats.total_hits < stats.total_lookups  # most experts were read from the host pool
    assert slots == [24, 6]
    assert outs[0] == outs[1]
