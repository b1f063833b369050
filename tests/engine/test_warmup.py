"""Start-up warm-up (engine/warmup.py): the token buckets, the planned rounds, and a real warm-up on
the tiny families that serves every round and leaves the engine as it found it."""

from __future__ import annotations

import pytest

from radianced.engine.warmup import GREEDY, SAMPLED, SPECULATIVE, Round, plan_rounds, token_buckets, warm_up
from radianced.kv.blocks import BlockAllocator
from tests.engine.conftest import FAMILIES, prompts, request, run_all, small_engine

# warm-up limits of small_engine's defaults: 48-token steps, 8 sequences, 64 blocks of 16 tokens (256 = 16 blocks)
MAX_BATCHED, MAX_SEQS, MAX_MODEL_LEN = 48, 8, 256


@pytest.mark.parametrize("limit,sizes", [
    (1, [1]),
    (2, [1, 2]),
    (5, [1, 2, 4, 5]),
    (2048, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]),
])
def test_token_buckets_are_the_powers_of_two_below_the_limit_then_the_limit(limit, sizes):
    assert token_buckets(limit) == sizes


@pytest.mark.parametrize("speculative", [0, 2])
def test_plan_of_a_small_engine(speculative):
    """8-token steps, 3 sequences, a 64-token context: a prefill of each bucket's size T and of T + 1
    (a prompt may pass the step limit: it runs as two steps), 2 and 3 one-token sequences together,
    the sampled rounds, and the forced-drafting rounds only with --speculative."""
    rounds = plan_rounds(8, 3, 64, speculative)
    want = [
        *(Round((n,), (GREEDY,)) for n in (1, 2, 3, 4, 5, 8, 9)),
        Round((1, 1), (GREEDY, GREEDY)), Round((1, 1, 1), (GREEDY, GREEDY, GREEDY)),
        Round((5,), (SAMPLED,)), Round((5, 7), (SAMPLED, GREEDY)),
    ]
    if speculative:
        want += [Round((8,), (SPECULATIVE,), drafting=True),
                 Round((8, 8), (SPECULATIVE, SPECULATIVE), drafting=True)]
    assert rounds == want
    assert all(n + p.max_tokens <= 64 for r in rounds for n, p in zip(r.lengths, r.params))


def test_the_longest_prefill_leaves_room_to_decode():
    """A 20-token context under 48-token steps: the last bucket is 20 - 12 - 1 = 7 tokens, so the prompt
    and any round's max_tokens fit; one sequence has no multi-sequence rounds and one sampled round."""
    rounds = plan_rounds(48, 1, 20, 0)
    assert rounds == [*(Round((n,), (GREEDY,)) for n in (1, 2, 3, 4, 5, 7)), Round((5,), (SAMPLED,))]
    assert all(n + p.max_tokens <= 20 for r in rounds for n, p in zip(r.lengths, r.params))


def free_blocks(allocator: BlockAllocator) -> int:
    """Blocks nobody holds: free ones on leased pages, plus the pages not leased (one block a page
    in small_engine's fixed pool)."""
    return sum(pool.num_free for pool in allocator.pools) + allocator.pages.available()


def record_plans(engine) -> list:
    """Every non-empty StepPlan the engine's scheduler makes from now on (the list fills as it steps)."""
    plans, schedule = [], engine.scheduler.schedule

    def spy():
        plan = schedule()
        if plan is not None and not plan.is_empty:
            plans.append(plan)
        return plan

    engine.scheduler.schedule = spy
    return plans


def check_warm_up_leaves_no_trace(rad, speculative: int) -> list:
    """Warm up an engine (its plans are returned): its steps include a decode of each sequence count,
    and no verify step unless drafting; then the scheduler drafts as configured again, nothing is left running or cached, every block is
    free again, no sampling tensors are kept, the report counts the plan, and two greedy prompts and a seeded-sampled one give what a
    never-warmed engine gives."""
    engine = small_engine(rad, speculative=speculative)
    allocator = engine.scheduler.allocator
    free_before = free_blocks(allocator)
    drafting = engine.scheduler.drafting
    plans = record_plans(engine)
    report = warm_up(engine, MAX_BATCHED, MAX_SEQS, MAX_MODEL_LEN, speculative, rad.model.vocab_size)
    del engine.scheduler.schedule  # the spy off: the plans are the warm-up's alone

    plan = plan_rounds(MAX_BATCHED, MAX_SEQS, MAX_MODEL_LEN, speculative)
    assert report.rounds == len(plan) and report.steps >= len(plan) > 0
    assert report.tokens == sum(sum(r.lengths) for r in plan)
    decodes = {len(p.seqs) for p in plans if all(len(s.token_ids) == 1 and s.context_before for s in p.seqs)}
    assert set(range(1, MAX_SEQS + 1)) <= decodes
    assert speculative or not any(s.drafts for p in plans for s in p.seqs)

    assert not engine.scheduler.has_unfinished
    assert engine.scheduler.drafting is drafting  # the forced drafting was the warm-up's alone
    assert engine.scheduler.prefix.num_cached == 0
    assert free_blocks(allocator) == free_before and allocator.num_used == 0
    assert engine.runner._sampling is None  # the last rows' tensors (penalty histories) are nobody's

    ps = prompts(rad.model.vocab_size, (11, 37), seed=5)

    def serve(e):
        return run_all(e, [request(e, "g0", ps[0]), request(e, "g1", ps[1], max_tokens=16),
                           request(e, "s", ps[0], temperature=0.8, top_k=20, seed=3)])

    assert serve(engine) == serve(small_engine(rad, speculative=speculative))
    return plans


@pytest.mark.parametrize("family", FAMILIES)
def test_warm_up_serves_every_round_and_leaves_no_trace(tiny_rads, family):
    check_warm_up_leaves_no_trace(tiny_rads[family], speculative=0)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@pytest.mark.parametrize("family", [
    "llama", "qwen3_moe",
    "qwen3_next",  # its first chunk ends on the last whole block (the checkpoint): T + 1 runs as T and 1
])
def test_warm_up_meets_every_token_bucket_in_one_step(tiny_rads, family):
    """Each power-of-two bucket of token_buckets(48) (the tile sizes follow the next power of two of a
    step's tokens) is the bucket of some warm-up step."""
    rad = tiny_rads[family]
    engine = small_engine(rad)
    plans = record_plans(engine)
    warm_up(engine, MAX_BATCHED, MAX_SEQS, MAX_MODEL_LEN, 0, rad.model.vocab_size)
    met = {next_power_of_2(p.num_tokens) for p in plans}
    assert {next_power_of_2(t) for t in token_buckets(MAX_BATCHED)} <= met


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_warm_up_with_drafts_leaves_no_trace(tiny_rads, family):
    """--speculative 2: the drafting rounds force 2 drafts on every decode step (random weights match
    nothing), so verify steps run on both families, the hybrid's per-position states included, and
    their rejected drafts' blocks are given back too."""
    plans = check_warm_up_leaves_no_trace(tiny_rads[family], speculative=2)
    assert any(len(s.drafts) == 2 for p in plans for s in p.seqs)


async def test_the_served_path_warm_up_runs_its_requests_uncounted(tiny_rads):
    """`warm_up_served`: two short requests (greedy and sampled), then one of two chunks, through a running
    AsyncEngine; the metrics see none of them, and the engine is left idle with every block free."""
    import asyncio

    from radianced.engine.driver import AsyncEngine
    from radianced.engine.warmup import warm_up_served

    class Counting:
        def __getattr__(self, name):
            def count(*args):
                calls.append(name)
            return count

    calls: list[str] = []
    rad = tiny_rads["qwen3_moe"]
    engine = small_engine(rad)
    ae = AsyncEngine(engine, Counting())
    calls.clear()  # what construction reported (the gauges' start)
    task = asyncio.create_task(ae.run())
    await warm_up_served(ae, rad.model.vocab_size)
    assert calls == [] and ae.steps >= 4 and isinstance(ae.metrics, Counting)
    assert not engine.scheduler.has_unfinished and engine.scheduler.allocator.num_used == 0
    task.cancel()
