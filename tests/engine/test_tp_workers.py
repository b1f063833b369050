"""`--tp 2` on the CPU, two real processes over gloo: rank 0 is this test process, running the
engine over its share of the model; rank 1 a spawned worker (`WorkerShard.serve_steps`). Every
tiny family gives the greedy tokens of `--tp 1` and logits within fp32 rounding of them, through
chunked prefills, a batch of several sequences and a prefix hit. With `--speculative 3` the
verify steps (drafts accepted, and rejected: the hybrid's draft states kept on both cards) give
the tokens of `--tp 1` with the same drafts, which are those without speculation; with the MTP head
(the tiny Qwen3-Next with its MTP layer), every card runs its share of the head's pass and rank 0's
drafts are one card's.

One spawn for the module (spawn costs seconds): the worker takes one job a family from rank 0
(the family's .rad and pool size), serves that engine's steps until it closes, then waits for
the next job.
"""

from __future__ import annotations


import pytest
import torch

from radianced.config import Config
from radianced.engine.engine import Engine
from radianced.engine.speculation import DraftPolicy, mtp_drafts
from radianced.engine.tp_workers import WorkerShard
from radianced.kv.blocks import BlockAllocator
from radianced.model.parallel import ProcessGroup
from radianced.model.rad import RadFile
from radianced.sharding import card_config, card_share
from tests.engine.conftest import BLOCK, FAMILIES, prompts, request
from tests.engine.test_speculation import Oracle, mtp_rad  # noqa: F401 (mtp_rad: a fixture)
from tests.engine.tp_ranks import jobs, two_ranks

NUM_BLOCKS, TOKENS = 64, 32
CFG = dict(max_num_seqs=8, max_num_batched_tokens=16, max_queue=64)  # 16: the 40-token prompt in 3 chunks
TOLERANCE = 1e-4  # measured: 4.2e-6 (llama), 4.4e-6 (qwen3_moe), 6.4e-6 (qwen3_next) of |logits| <= 5.5: fp32,
# the partial sums added in another order


def _worker(rank: int, port: int) -> None:
    for group, (path, cfg) in jobs(rank, port):
        WorkerShard.build(RadFile.open(path), Config(**cfg), group, NUM_BLOCKS, BLOCK).serve_steps()


@pytest.fixture(scope="module")
def group():
    with two_ranks(_worker) as g:
        yield g


def _engine(rad: RadFile, group: ProcessGroup | None, **flags) -> Engine:
    m = card_config(rad.model, card_share(rad.model, group.rank, group.size)) if group else rad.model
    flags = {**CFG, **flags}
    cfg = Config(**flags, tp=group.size if group else 1)
    layers = len(m.full_attention_layers) + cfg.drafts_with_mtp(m.num_mtp_layers)  # the MTP layer's KV: one more
    storage = torch.zeros((NUM_BLOCKS, 1, layers, 2, BLOCK, m.num_key_value_heads, m.head_dim))
    if group is None:
        return Engine.assemble(rad, cfg, storage, BlockAllocator.fixed(NUM_BLOCKS, BLOCK))
    import torch.distributed as dist

    dist.broadcast_object_list([(str(rad.path), flags)], src=0)
    return Engine.assemble(rad, cfg, storage, BlockAllocator.fixed(NUM_BLOCKS, BLOCK), group=group)


def _serve(engine: Engine, rounds: list[list[list[int]]], ahead: bool = False):
    """Each round's prompts as one batch, greedy for TOKENS tokens (`ahead`: pipelined, as the daemon
    steps); (tokens per request id, every step's logits, the reused tokens per request id)."""
    logits, forward = [], engine.runner.model.forward

    def recorded(*args, **kwargs):
        out = forward(*args, **kwargs)
        logits.append((out[0] if isinstance(out, tuple) else out).clone())  # (logits, hidden) where MTP drafts
        return out

    engine.runner.model.forward = recorded
    tokens, reused = {}, {}
    for r, batch in enumerate(rounds):
        seqs = {f"r{r}s{i}": engine.add(request(engine, f"r{r}s{i}", p, max_tokens=TOKENS, ignore_eos=True))
                for i, p in enumerate(batch)}
        while engine.scheduler.has_unfinished:
            for ev in engine.step(ahead):
                tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
        assert engine.step() == []  # nothing left in flight
        reused.update({rid: s.num_reused_tokens for rid, s in seqs.items()})
    engine.close()
    return tokens, logits, reused


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_gives_tp1s_tokens_and_logits(tiny_rads, group, family):
    rad = tiny_rads[family]
    a, b, c, d = prompts(rad.model.vocab_size, (40, 7, 23, 9), seed=3)
    one = _serve(_engine(rad, None), [[a, b, c]])
    follow_up = a + one[0]["r0s0"] + d  # the first prompt and its answer again: a prefix hit
    rounds = [[a, b, c], [follow_up, d]]
    tp1, tp2 = _serve(_engine(rad, None), rounds), _serve(_engine(rad, group), rounds)
    assert tp2[0] == tp1[0] and all(len(t) == TOKENS for t in tp2[0].values())
    assert tp2[2] == tp1[2] and tp2[2]["r1s0"] >= 2 * BLOCK
    assert len(tp2[1]) == len(tp1[1])
    diff = max((x - y).abs().max().item() for x, y in zip(tp2[1], tp1[1]) if x.numel())  # chunks sample nothing
    assert diff <= TOLERANCE, f"{family}: logits of --tp 2 differ from --tp 1 by {diff}"


SPECULATIVE = dict(speculative=3, max_num_batched_tokens=32)  # a step decodes 4 tokens for each of 8 sequences


def _drafting(engine: Engine, ps: list[list[int]], runs: dict | None) -> list:
    """Let `engine` draft for `ps` with the oracle of `runs` (every second proposal's second draft wrong), or
    with its n-gram drafter (runs None) and the cost model's r fixed (measured while serving, it would follow
    each engine's own step times); the scheduler's sequences, as they are added."""
    engine.scheduler.drafting.served = None
    if runs is not None:
        oracle = Oracle(runs, wrong_every=2)
        engine.scheduler.drafting.policy = DraftPolicy(3, 0.6, adaptive=False,
                                                       propose=lambda seq, k: oracle(seq.token_ids, k))
    seqs, add = [], engine.add
    engine.add = lambda r: seqs.append(add(r)) or seqs[-1]
    return seqs


@pytest.mark.parametrize("family,drafter", [("llama", "ngram"), ("qwen3_next", "oracle")])
def test_tp2_verifies_drafts_with_tp1s_tokens(tiny_rads, group, family, drafter):
    """llama: its n-gram drafts, on a prompt whose greedy answer repeats a token (6 drafted, 2
    accepted); qwen3_next, whose random weights repeat nothing for n-grams to find: an oracle's
    drafts, half of them partly wrong, so its verify steps keep a draft state on both cards."""
    rad = tiny_rads[family]
    ps = [prompts(rad.model.vocab_size, (8,), seed=60)[0]] + prompts(rad.model.vocab_size, (23, 9), seed=3)
    plain = _serve(_engine(rad, None), [ps])[0]
    runs = None if drafter == "ngram" else {tuple(p): tuple(plain[f"r0s{i}"]) for i, p in enumerate(ps)}
    one = _engine(rad, None, **SPECULATIVE)
    seqs1 = _drafting(one, ps, runs)
    tp1 = _serve(one, [ps])
    two = _engine(rad, group, **SPECULATIVE)
    seqs2 = _drafting(two, ps, runs)
    tp2 = _serve(two, [ps])
    assert tp2[0] == tp1[0] == plain
    stats = [[(s.draft_stats.drafted, s.draft_stats.accepted) for s in seqs] for seqs in (seqs1, seqs2)]
    assert stats[0] == stats[1]
    drafted, accepted = (sum(n) for n in zip(*stats[1]))
    assert drafted > accepted > 0, stats[1]
    diff = max((x - y).abs().max().item() for x, y in zip(tp2[1], tp1[1]) if x.numel())
    assert diff <= TOLERANCE, f"{family}: logits of --tp 2 differ from --tp 1 by {diff}"


def test_tp2_drafts_with_the_mtp_head_on_every_card_with_tp1s_tokens_and_drafts(mtp_rad, group):
    """--speculative 2 --speculative-method mtp: each card runs its share of the head after every step
    (prefill chunks included) and rank 0's drafts, chained ones too, are one card's: the same proposals,
    the same accepted counts and the tokens of a run without speculation. Pipelined, as the daemon steps:
    a prefill chunk's successor is launched before the chunk's head pass runs."""
    flags = dict(speculative=2, speculative_method="mtp", max_num_batched_tokens=24)  # 24: 8 sequences' 3 tokens
    assert Config(**{**CFG, **flags, "speculative_method": "auto"}, tp=2).drafts_with_mtp(1)  # under --tp too
    ps = prompts(mtp_rad.model.vocab_size, (40, 7, 23), seed=3)
    plain = _serve(_engine(mtp_rad, None), [ps])[0]
    runs = []
    for g in (None, group):
        engine = _engine(mtp_rad, g, **flags)
        assert engine.runner.model.mtp is not None
        engine.scheduler.drafting.policy = DraftPolicy(2, 0.6, adaptive=False, propose=mtp_drafts)  # every step
        seqs, proposals, update = _drafting(engine, ps, None), [], engine.scheduler.update
        engine.scheduler.update = lambda plan, output: (proposals.append(output.drafts), update(plan, output))[1]
        overlapped, execute = [], engine.execute
        engine.execute = lambda work: (overlapped.append(work.launch is not None and work.collect is not None),
                                       execute(work))[1]
        runs.append((_serve(engine, [ps], ahead=True), [(s.draft_stats.drafted, s.draft_stats.accepted) for s in seqs],
                     proposals, sum(overlapped)))
    (tp1, stats1, proposals1, _), (tp2, stats2, proposals2, overlapped) = runs
    assert overlapped > 0  # a step launched before the head's pass of the one before it
    assert tp2[0] == tp1[0] == plain
    assert proposals2 == proposals1 and sum(len(d) == 2 for p in proposals2 for d in p) > 10  # chained drafts
    assert stats2 == stats1
    drafted, accepted = (sum(n) for n in zip(*stats2))
    assert drafted > accepted > 0, stats2
    diff = max((x - y).abs().max().item() for x, y in zip(tp2[1], tp1[1]) if x.numel())
    assert diff <= TOLERANCE, f"logits of --tp 2 differ from --tp 1 by {diff}"
