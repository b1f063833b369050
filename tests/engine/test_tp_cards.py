"""Each card's memory under `--tp 2` on the CPU, two real processes over gloo: rank 0 is this test
process (`Engine.build` over its card), rank 1 a spawned worker (`WorkerShard.for_card`).

Each card keeps its own experts (0-3 or 4-7 of every layer) in its own slots, host pool or model
file, as its receipt places them, and reads its own misses inside the step. Greedy tokens equal
one card's with the same flags; the lookups and assignments the cards count, summed on rank 0,
equal one card's, per layer and per decoding sequence and step; each card's allocation is its
receipt's. A small card makes rank 0's KV take cached expert slots back, and card 1 follows it
page for page. A read that fails on card 1 fails only the request routed to that expert. A
quantized KV cache is quantized on each card as on one: the tokens of one card with the same
`--kv-cache-dtype`.

One spawn for the module (spawn costs seconds): the worker takes one job at a time from rank 0
(the .rad, the flags, and an expert whose first read on card 1 fails, or None), serves that engine's steps until it closes, then sends back what it
allocated and how many slot pages it gave up to KV.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from radianced.arena import EXPERTS, KV, Arena
from radianced.card import Card
from radianced.config import Config
from radianced.engine.engine import Engine
from radianced.engine.tp_workers import WorkerShard
from radianced.model.experts import ResidentExperts
from radianced.model.parallel import ProcessGroup
from radianced.model.rad import RadFile
from radianced.engine.request import FinishReason
from radianced.engine.tp_counts import FAILED_ELSEWHERE
from radianced.tiers.faults import Faults
from radianced.tiers.host import HostPool
from radianced.tiers.slab import ExpertSlab
from tests.engine.conftest import prompts, request, run_all
from tests.engine.test_disk_tier import run_events
from tests.engine.test_speculation import mtp_rad  # noqa: F401 (a fixture)
from tests.engine.tp_ranks import jobs, two_ranks

CFG = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, max_queue=64)
HOST_POOL = dict(card_mib=256, host_pool_mib=1, expert_slots=4)  # every expert in its card's host pool
DISK = dict(card_mib=256, host_pool_mib=0, weights_disk_tier=True, expert_slots=3)  # ... in the model file
# qwen3_moe: a card of 20 (card 0) and 23 (card 1) arena pages, 12 of them expert slots at start: four
# requests of ~160 tokens need 12 pages of KV (64 tokens a page), so rank 0's KV takes slots back
SMALL_CARD = dict(card_mib=33, gpu_headroom_mib=0, max_num_batched_tokens=172, host_pool_mib=1)


def _allocation(arena: Arena, slab: ExpertSlab | None, resources: list) -> dict:
    """What a card allocated, in its receipt's terms."""
    pools = [r for r in resources if isinstance(r, HostPool)]
    homes = [slab.placement.count(h) if slab else 0 for h in ("card", "host", "disk")]
    return dict(arena_pages=arena.num_pages, page_bytes=arena.page_bytes, disk_buffer_pages=len(arena.reserved),
                arena_alloc_bytes=arena.storage.numel(), expert_slots=arena.held(EXPERTS),
                slots=slab.num_slots if slab else 0, experts_pinned=homes[0], experts_host=homes[1],
                experts_disk=homes[2], host_pool_bytes=sum(p.nbytes for p in pools))


def _receipt(r) -> dict:
    return dict(arena_pages=r.arena_pages, page_bytes=r.page_bytes, disk_buffer_pages=r.disk_buffer_pages,
                arena_alloc_bytes=r.arena_alloc_bytes, expert_slots=r.expert_slots, slots=r.expert_slots,
                experts_pinned=r.experts_pinned, experts_host=r.experts_host, experts_disk=r.experts_disk,
                host_pool_bytes=r.experts_host * r.page_bytes, **_head_receipt(r))


def _head(model, cache) -> dict:
    """What a card allocated for the MTP head where it drafts: the bytes of the tensors its share holds
    (fc, norms, its layer's parts and routed experts; the shared embedding and lm_head are the model's),
    and the KV cache's layers (the head's one more); nothing without a head."""
    if model.mtp is None:
        return {}
    held: dict[int, int] = {}

    def visit(v) -> None:
        if isinstance(v, torch.Tensor):
            held[id(v)] = v.nbytes
        elif isinstance(v, ResidentExperts):  # its slab; the tables say where an expert is
            visit(v.slab)
        elif isinstance(v, (list, tuple)):
            for item in v:
                visit(item)
        elif type(v).__module__.startswith("radianced.model.") and hasattr(v, "__dict__") \
                and v is not model.embed and v is not model.lm_head:
            for item in vars(v).values():
                visit(item)

    visit(model.mtp)
    return dict(mtp_bytes=sum(held.values()), kv_layers=cache.storage.shape[2])


def _head_receipt(r) -> dict:
    weights = {p.name: p.bytes for p in r.weights}
    return dict(mtp_bytes=weights["mtp"], kv_layers=r.groups[0].layers) if "mtp" in weights else {}


def _worker(rank: int, port: int) -> None:
    for group, (path, flags, fault) in jobs(rank, port):
        shard = WorkerShard.for_card(RadFile.open(path), Config(**flags), group)
        memory = shard.memory
        allocated, slab, given = _allocation(memory.arena, memory.experts, memory.resources), memory.experts, []
        allocated.update(_head(shard.model, shard.cache))
        if fault is not None:
            slab.loader.reader.faults = Faults()
            slab.loader.reader.faults.fail(*fault)
        if slab is not None:
            give_up = slab.give_up
            slab.give_up = lambda pages: (given.extend(pages), give_up(pages))[1]
        shard.serve_steps()
        dist.broadcast_object_list([(allocated, len(given))], src=1)


@pytest.fixture(scope="module")
def group():
    with two_ranks(_worker) as g:
        yield g


def _serve(engine: Engine, ps: list[list[int]], max_tokens: int):
    """Every prompt at once, greedy; (tokens per request id, per step the decoding sequences'
    (lookups, routed) counts)."""
    counts, collect = [], engine.runner.collect

    def counted(step):
        out = collect(step)
        counts.append([None if c is None else (c[0], c[2]) for c in out.expert_counts or ()])
        return out

    engine.runner.collect = counted
    for i, p in enumerate(ps):
        engine.add(request(engine, f"r{i}", p, max_tokens=max_tokens, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.scheduler.has_unfinished:
        for ev in engine.step():
            tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
    return tokens, counts


def _one_card(rad: RadFile, flags: dict) -> Engine:
    return Engine.build(rad, Config(**flags), Card.from_mib(flags["card_mib"], cuda=False))


def _two_cards(rad: RadFile, flags: dict, group: ProcessGroup, fault: tuple[int, int] | None = None) -> Engine:
    dist.broadcast_object_list([(str(rad.path), {**flags, "tp": 2}, fault)], src=0)
    return Engine.build(rad, Config(**flags, tp=2), group=group)


def _finish(engine: Engine) -> tuple[dict, int]:
    """Close rank 0's engine (the worker's steps end); what card 1 allocated and gave up to KV."""
    engine.close()
    answer = [None]
    dist.broadcast_object_list(answer, src=1)
    return answer[0]


@pytest.mark.parametrize("family,tier", [("qwen3_moe", "host"), ("qwen3_next", "host"), ("qwen3_moe", "disk"),
                                         ("qwen3_next", "disk")])
def test_each_card_serves_its_experts_from_its_own_tiers_with_one_cards_tokens_and_counts(
        tiny_rads, group, family, tier):
    rad = tiny_rads[family]
    flags = {**CFG, **(HOST_POOL if tier == "host" else DISK)}
    ps = prompts(rad.model.vocab_size, (40, 7, 23), seed=5)
    one = _one_card(rad, flags)
    want, want_counts = _serve(one, ps, 16)
    two = _two_cards(rad, flags, group)
    slab, receipts = two.experts, two.cards.receipts
    allocated0 = _allocation(two.arena, slab, two.resources)
    got, got_counts = _serve(two, ps, 16)
    allocated1, _ = _finish(two)
    assert got == want
    assert got_counts == want_counts  # every step's decoding sequences: lookups and assignments of both cards
    assert (slab.stats.lookups, slab.stats.routed) == (one.experts.stats.lookups, one.experts.stats.routed)
    home = "experts_host" if tier == "host" else "experts_disk"
    assert [getattr(r, home) for r in receipts] == ([12, 12] if family == "qwen3_moe" else [16, 16])
    assert allocated0 == _receipt(receipts[0]) and allocated1 == _receipt(receipts[1])
    assert slab.stats.total_hits < slab.stats.total_lookups  # some experts were read from the tiers
    if tier == "disk":
        assert slab.stats.disk_reads > 0


def test_card_1_gives_rank_0s_kv_the_slot_pages_rank_0_gives_it(tiny_rads, group):
    rad = tiny_rads["qwen3_moe"]
    flags = {**CFG, **SMALL_CARD}
    ps = prompts(rad.model.vocab_size, (100, 104, 108, 112), seed=31)
    reference = Engine.build(rad, Config(**{**CFG, "max_num_batched_tokens": 172}), Card.from_mib(256, cuda=False))
    want, _ = _serve(reference, ps, 48)
    two = _two_cards(rad, flags, group)
    assert [(r.arena_pages, r.expert_slots) for r in two.cards.receipts] == [(12, 8), (14, 10)]
    got, _ = _serve(two, ps, 48)
    moved = dict(two.arena.stats().moved)
    _, given = _finish(two)
    assert got == want
    assert moved.get((EXPERTS, KV), 0) > 0 and given > 0


def test_a_read_that_fails_on_card_1_fails_only_the_request_routed_to_that_expert(tiny_rads, group):
    rad = tiny_rads["qwen3_moe"]
    flags = {**CFG, **DISK, "expert_slots": 0}  # every routed expert read from the file in every step
    a, b = prompts(rad.model.vocab_size, (20, 2), seed=7)
    one = _one_card(rad, flags)
    calls, prepare = [], one.experts.prepare
    one.experts.prepare = lambda layer, ids: (calls.append((layer, ids.clone())), prepare(layer, ids))[1]
    want = run_all(one, [request(one, "a", a), request(one, "b", b)])
    # an expert of card 1 (4-7) that a's rows route in the first step and b's do not
    layer, expert = next((layer, min(only_a)) for layer, ids in calls[:3]
                         if (only_a := {e for e in ids[:20].flatten().tolist() if e >= 4}
                             - set(ids[20:].flatten().tolist())))
    two = _two_cards(rad, flags, group, fault=(layer, expert))
    events = run_events(two, [request(two, "a", a), request(two, "b", b)])
    _finish(two)
    (failed,) = events["a"]
    assert failed.finish_reason is FinishReason.ERROR and failed.error == FAILED_ELSEWHERE
    assert [t for ev in events["b"] for t in ev.token_ids] == want["b"]


@pytest.mark.parametrize("family,kv_dtype", [("llama", "fp8"), ("qwen3_moe", "fp8_v4"), ("qwen3_next", "k6_v4")])
def test_a_quantized_kv_cache_gives_one_cards_tokens(tiny_rads, group, family, kv_dtype):
    rad = tiny_rads[family]
    flags = {**CFG, "card_mib": 256, "kv_cache_dtype": kv_dtype}
    ps = prompts(rad.model.vocab_size, (40, 7, 23), seed=9)
    want, _ = _serve(_one_card(rad, flags), ps, 16)
    two = _two_cards(rad, flags, group)
    r, storage = two.receipt, two.runner.cache.storage
    assert storage.dtype == torch.uint8 and storage.shape == (r.arena_pages, r.blocks_per_page(r.groups[0]),
                                                              r.groups[0].block_bytes)
    got, _ = _serve(two, ps, 16)
    allocated1, _ = _finish(two)
    assert got == want
    assert allocated1 == _receipt(two.cards.receipts[1])


def test_the_mtp_head_drafts_on_both_cards_each_allocating_its_receipts_share_of_it(mtp_rad, group):
    """--speculative 2 --speculative-method mtp on two cards: one card's tokens; each card holds its half
    of the head (its heads, shared expert columns and routed experts 0-3 or 4-7, fc and norms whole) and
    pages its KV as one more layer, as its receipt charges them."""
    flags = {**CFG, **HOST_POOL, "speculative": 2, "speculative_method": "mtp"}
    ps = prompts(mtp_rad.model.vocab_size, (40, 7, 23), seed=5)
    one = _one_card(mtp_rad, flags)
    want, _ = _serve(one, ps, 16)
    two = _two_cards(mtp_rad, flags, group)
    allocated0 = {**_allocation(two.arena, two.experts, two.resources), **_head(two.runner.model, two.runner.cache)}
    got, _ = _serve(two, ps, 16)
    allocated1, _ = _finish(two)
    assert got == want
    receipts = two.cards.receipts
    assert allocated0 == _receipt(receipts[0]) and allocated1 == _receipt(receipts[1])
    assert allocated1["kv_layers"] == len(mtp_rad.model.full_attention_layers) + 1
    whole = {p.name: p.bytes for p in one.receipt.weights}["mtp"]
    assert whole / 2 < allocated1["mtp_bytes"] < whole  # half the layer; fc and the norms on both cards
