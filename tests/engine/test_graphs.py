"""The step graphs' layouts on the CPU: `StepGraphs(capture=False)` runs the padded static
batches (decode, and mixed: any other step of up to a bucket's tokens) eagerly, and hands the slab
its routing as a replay does (the stacked record of `ExpertSlab.record`, padding rows included),
so the tokens, the expert accounting and the KV it writes must equal the plain eager runner's.
(The capture and replay themselves are checked on the GPU: tests/gpu/test_decode_graphs.py,
tests/gpu/test_mixed_graphs.py.)
"""

from __future__ import annotations

import pytest

from radianced.card import Card
from radianced.config import Config
from radianced.engine.engine import Engine
from radianced.engine.graphs import StepGraphs
from radianced.engine.warmup import forced_drafting
from radianced.graph_shapes import decode_buckets, mixed_buckets, mixed_buckets_of
from radianced.sizing import BLOCK_TOKENS
from tests.engine.conftest import prompts, request, run_all
from tests.kernels.compare import rel_err

CFG = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
EXPERTS = dict(host_pool_mib=1, expert_slots=6)  # experts split between slots and the host pool


def build(rad, flags: dict, graphs: bool, mixed: bool = False) -> Engine:
    """An engine on the CPU; with `graphs`, its decode steps (with `mixed`, also the other steps that fit
    a mixed bucket) run the padded static batches (`StepGraphs(capture=False)`), as a replay would."""
    cfg = Config(**{**CFG, **flags})
    engine = Engine.build(rad, cfg, Card.from_mib(256))
    if graphs:
        runner = engine.runner
        recurrent = runner.cache.states is not None  # the engine's rule: a hybrid's verify steps alone
        buckets = mixed_buckets_of(recurrent, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.decode_tokens) \
            if mixed else ()
        runner.graphs = StepGraphs(runner.model, runner.cache, cfg.max_num_seqs, cfg.max_model_len // BLOCK_TOKENS,
                                   engine.experts,
                                   capture=False, mixed=buckets, decode_tokens=cfg.decode_tokens)
    return engine


def test_buckets_end_at_max_num_seqs():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(4) == (1, 2, 4)
    assert decode_buckets(40) == (1, 2, 4, 8, 16, 24, 32, 40)


def test_mixed_buckets_are_powers_of_two_then_multiples_of_256_above_the_sequences_up_to_the_step_budget():
    assert mixed_buckets(4, 64) == (16, 32, 64)
    assert mixed_buckets(8, 2048) == (16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048)
    assert mixed_buckets(16, 512) == (32, 64, 128, 256, 512)  # 16 tokens over 16 slots is decode-shaped
    assert mixed_buckets(8, 1000) == (16, 32, 64, 128, 256, 512, 768, 1000)  # the budget: a graph of its own
    assert mixed_buckets(4, 100) == (16, 32, 64, 100)
    assert mixed_buckets(64, 100) == (100,)
    assert mixed_buckets(256, 8192) == (512, 768, 1024, 1280, 1536, 1792, 2048)  # past 2,048 tokens: eager
    assert mixed_buckets(8, 8) == ()


def test_a_hybrid_model_has_mixed_graphs_for_its_verify_steps_alone():
    assert mixed_buckets_of(False, 4, 64, 4) == mixed_buckets(4, 64)  # attention families: every step shape
    assert mixed_buckets_of(True, 4, 64, 4) == ()  # no drafts: a step of every sequence is decode-shaped
    assert mixed_buckets_of(True, 4, 64, 16) == (16,)  # --speculative 3: up to 4 sequences' 4 tokens
    assert mixed_buckets_of(True, 8, 2048, 40) == (16, 32, 40)
    assert mixed_buckets_of(True, 8, 24, 40) == (16, 24)  # within the step budget


def _mixed_calls(engine: Engine) -> list[tuple[int, int]]:
    """(tokens, logits rows) of every step the engine runs through `run_mixed`, as they come."""
    calls, graphs = [], engine.runner.graphs
    replay = graphs.run_mixed

    def recorded(layout, pending=None, state_slots=None):
        calls.append((len(layout.ids), len(layout.rows)))
        return replay(layout, pending, state_slots)

    graphs.run_mixed = recorded
    return calls


# (step budget, prompt lengths): small steps; prompts long enough for the buckets past 256 tokens (512, and the
# budget itself)
SHAPES = {"small": (64, (9, 33, 50, 21)), "long": (520, (300, 450, 120, 21))}


@pytest.mark.parametrize("shape", ["small", "long"])
@pytest.mark.parametrize("family, flags", [("llama", {}), ("qwen3_moe", EXPERTS)])
def test_mixed_steps_in_the_padded_static_batch_give_the_eager_tokens_and_counts(tiny_rads, family, flags, shape):
    """Prompts of 9, 33 and 50 tokens under a 64-token step budget: chunks of prefill beside decodes, and
    whole short prompts, each step in the smallest mixed bucket it fits (16, 32 or 64 rows, the rest
    padding owned by no sequence); a fourth request arrives mid-run. The same with prompts of 120-450 tokens
    under a 520-token budget. Tokens and expert counts equal the eager engine's."""
    rad = tiny_rads[family]
    budget, lengths = SHAPES[shape]
    ps = prompts(rad.model.vocab_size, lengths, seed=53)
    runs, calls = [], []
    for graphs in (False, True):
        engine = build(rad, {**flags, "max_num_batched_tokens": budget, "max_model_len": 512}, graphs, mixed=True)
        if graphs:
            calls = _mixed_calls(engine)
        out: dict = {}
        for i, p in enumerate(ps[:3]):
            engine.add(request(engine, f"p{i}", p, max_tokens=12))
        steps = 0
        while engine.scheduler.has_unfinished:
            for ev in engine.step():
                out.setdefault(ev.request_id, []).extend(ev.token_ids)
            steps += 1
            if steps == 4:
                engine.add(request(engine, "p3", ps[3], max_tokens=12))
        stats = engine.experts.stats if engine.experts is not None else None
        runs.append((out, stats and (stats.lookups, stats.hits, stats.routed)))
    assert runs[0] == runs[1]
    assert len(calls) >= 3 and all(tokens <= budget for tokens, _ in calls)
    assert any(tokens > 16 for tokens, _ in calls) and any(rows > 1 for _, rows in calls)  # chunks beside decodes
    if shape == "long":
        assert any(tokens > 256 for tokens, _ in calls)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "qwen3_next"])
def test_verify_steps_in_the_padded_static_batch_give_the_greedy_tokens_of_plain_decoding(tiny_rads, family):
    """--speculative 3 (n-gram), every decode drafting its 3 tokens (the warm-up's `forced_drafting`: random
    weights would accept too little for adaptive drafting to go on): every verify step (each sequence's
    last token and 3 drafts, logits at each) runs in a mixed bucket; the greedy tokens equal plain eager
    decoding's. qwen3_next: its verify ops read the sequences' state slots from the static batch, the draft
    states are kept as eagerly (a partly accepted step's state is its accepted position's), and its prompts'
    chunks run eagerly (no mixed step but verify steps)."""
    rad = tiny_rads[family]
    ps = prompts(rad.model.vocab_size, (24, 20), seed=54)
    plain_engine = build(rad, {}, False)
    plain = run_all(plain_engine, [request(plain_engine, f"p{i}", p, max_tokens=16) for i, p in enumerate(ps)])
    engine = build(rad, dict(speculative=3), True, mixed=True)
    engine.scheduler.drafting = forced_drafting(engine.scheduler.drafting)
    calls = _mixed_calls(engine)
    drafted = run_all(engine, [request(engine, f"p{i}", p, max_tokens=16) for i, p in enumerate(ps)])
    assert drafted == plain
    assert sum(rows == tokens == 8 for tokens, rows in calls) >= 4  # 2 sequences x (1 + 3 drafts), logits at each
    if family == "qwen3_next":
        assert all(rows == tokens for tokens, rows in calls)  # verify steps alone: every row samples


@pytest.mark.parametrize("family, flags", [("llama", {}), ("qwen3_moe", EXPERTS), ("qwen3_next", EXPERTS)])
def test_padded_static_decode_batches_give_the_eager_tokens_and_counts(tiny_rads, family, flags):
    rad = tiny_rads[family]
    ps = prompts(rad.model.vocab_size, (9, 33, 50), seed=51)  # 3 sequences: bucket 4, one padding row
    runs = []
    for graphs in (False, True):
        engine = build(rad, flags, graphs)
        replays = []
        if graphs and engine.experts is not None:
            replay = engine.experts.replay
            engine.experts.replay = lambda recording: (replays.append(recording.ids.shape), replay(recording))
        tokens = run_all(engine, [request(engine, f"p{i}", p, max_tokens=12) for i, p in enumerate(ps)])
        stats = engine.experts.stats if engine.experts is not None else None
        runs.append((tokens, stats and (stats.lookups, stats.hits, stats.routed)))
        if graphs and engine.experts is not None:  # the decode steps counted the stacked records, padded
            assert len(replays) >= 10 and replays[0][0] == 4 and {shape[0] for shape in replays} <= {1, 2, 4}
    assert runs[0] == runs[1]


def test_hybrid_decode_graphs_give_the_eager_tokens_and_states_as_slots_are_reused(tiny_rads):
    """qwen3_next: padding rows carry state slot -1 and touch no recurrent state. Three sequences
    decode in bucket 4; the first finishes and a fourth joins into its freed state slot (restoring
    the first prompt's checkpoint) and decodes beside the others, padded again. Tokens, state
    slots and checkpoints end as the eager engine leaves them (up to rounding)."""
    rad = tiny_rads["qwen3_next"]
    ps = prompts(rad.model.vocab_size, (33, 21, 40, 7), seed=52)
    joiner = ps[0][:32] + ps[3]  # shares the first prompt's two blocks: restores its checkpoint
    runs = []
    for graphs in (False, True):
        engine = build(rad, EXPERTS, graphs)
        runner = engine.runner
        calls = []
        if graphs:
            def recorded(ids, pos, tables, slots, pending=None, replay=runner.graphs.run):
                calls.append(tuple(slots))  # the state slots of every step that ran the static batch
                return replay(ids, pos, tables, slots, pending)

            runner.graphs.run = recorded
        out = {}
        first = [engine.add(request(engine, f"p{i}", p, max_tokens=n, ignore_eos=True))
                 for i, (p, n) in enumerate(zip(ps[:3], (4, 12, 20)))]
        late = None
        while engine.scheduler.has_unfinished:
            for ev in engine.step():
                out.setdefault(ev.request_id, []).extend(ev.token_ids)
            if late is None and first[0].finish_reason is not None:
                late = engine.add(request(engine, "p3", joiner, max_tokens=12, ignore_eos=True))
        assert late.num_reused_tokens == 32
        runs.append((out, runner.cache.states, runner.checkpoints, calls))
    (eager, states, checkpoints, _), (graphed, g_states, g_checkpoints, calls) = runs
    assert graphed == eager
    # the same values up to rounding (the eager matmuls see 3 rows, the static batch's 4)
    for a, b in ((states, g_states), (checkpoints, g_checkpoints)):
        assert rel_err(b.conv, a.conv) < 1e-5 and rel_err(b.recurrent, a.recurrent) < 1e-5
    # slot 3 (the pool's last row, where an index of -1 would land) was never anyone's: still zeros
    assert not g_states.conv[:, 3].any() and not g_states.recurrent[:, 3].any()
    # seq 0..2 hold slots 0..2 (bucket 4, one padding row); then the joiner decodes in slot 0 beside 1 and 2
    assert (0, 1, 2) in calls and (1, 2, 0) in calls
