"""The per-request expert line (SPEC §9) and the expert metrics, through the async driver.

Tiny Qwen3-MoE with 6 expert slots and the rest in the host pool. Both prompts
prefill in the first step; every later step decodes one token of each.
"""

from __future__ import annotations

import logging
import re

from radianced.card import Card
from radianced.config import Config
from radianced.engine.engine_metrics import NoMetrics
from radianced.engine.engine import Engine
from radianced.engine.request import Request
from radianced.engine.sampling_params import SamplingParams
from radianced.engine.speculation import DraftPolicy
from tests.engine.conftest import prompts, serve_greedy

LINE = re.compile(r"(\S+): decode expert cache hit rate: ([\d.]+)% \((\d+) hits / (\d+) lookups\); (\d+) more read "
                  r"over PCIe or from disk \(([\d.]+)% of all (\d+) routed\)")
MAX_TOKENS = 8


class StepLog(NoMetrics):
    def __init__(self):
        self.steps: list[tuple[int, int, int]] = []

    def add_expert_lookups(self, kind: str, lookups: int, hits: int, overflow_bytes: int) -> None:
        self.steps.append((lookups, hits, overflow_bytes))


def _lines(caplog) -> dict[str, tuple]:
    out = {}
    for rec in caplog.records:
        m = LINE.fullmatch(rec.getMessage())
        if m:
            rid, rate, h, l, o, opct, r = m.groups()
            out[rid] = (float(rate), int(h), int(l), int(o), float(opct), int(r))
    return out


def moe_engine(rad) -> Engine:
    cfg = Config(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, host_pool_mib=1, expert_slots=6)
    return Engine.build(rad, cfg, Card.from_mib(256))


async def test_one_request_line_equals_the_slab_over_its_decode_steps(tiny_rads, caplog):
    caplog.set_level(logging.INFO, logger="radianced.requests")
    rad = tiny_rads["qwen3_moe"]
    engine = moe_engine(rad)
    slab = engine.experts
    metrics = await serve_greedy(engine, prompts(rad.model.vocab_size, (20,), seed=41), MAX_TOKENS, StepLog())
    lines = _lines(caplog)
    assert set(lines) == {"r0"}
    rate, h, l, o, opct, r = lines["r0"]
    decode = metrics.steps[1:]  # step 0 prefilled the prompt and sampled the first token
    assert len(decode) == MAX_TOKENS - 1
    assert l == sum(s[0] for s in decode) and h == sum(s[1] for s in decode)
    assert o == l - h > 0
    # one token per decode step: each of its k experts is one lookup and one assignment
    moe_layers, k = len(slab.stats.lookups), rad.model.num_experts_per_tok
    assert r == l == (MAX_TOKENS - 1) * moe_layers * k
    assert rate == round(100 * h / l, 1) and opct == round(100 * o / r, 1)
    assert sum(s[2] for s in metrics.steps) == (slab.stats.total_lookups - slab.stats.total_hits) * slab.extent_bytes
    assert sum(s[0] for s in metrics.steps) == slab.stats.total_lookups


async def test_two_requests_each_count_an_expert_they_share_in_a_step(tiny_rads, caplog):
    caplog.set_level(logging.INFO, logger="radianced.requests")
    rad = tiny_rads["qwen3_moe"]
    engine = moe_engine(rad)
    slab = engine.experts
    metrics = await serve_greedy(engine, prompts(rad.model.vocab_size, (9, 20), seed=42), MAX_TOKENS, StepLog())
    lines = _lines(caplog)
    assert set(lines) == {"r0", "r1"}
    moe_layers, k = len(slab.stats.lookups), rad.model.num_experts_per_tok
    for rate, h, l, o, opct, r in lines.values():
        assert r == l == (MAX_TOKENS - 1) * moe_layers * k and o == l - h
    decode = metrics.steps[1:]
    assert len(decode) == MAX_TOKENS - 1
    step_lookups = sum(s[0] for s in decode)
    step_misses = sum(s[0] - s[1] for s in decode)
    # per request, an expert both needed in one step counts twice; the slab moved it once
    assert sum(v[2] for v in lines.values()) > step_lookups
    assert sum(v[3] for v in lines.values()) >= step_misses


async def test_a_dense_model_prints_no_expert_line(tiny_rads, caplog):
    caplog.set_level(logging.INFO, logger="radianced.requests")
    rad = tiny_rads["llama"]
    engine = Engine.build(rad, Config(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64),
                          Card.from_mib(256))
    metrics = await serve_greedy(engine, prompts(rad.model.vocab_size, (9,), seed=43), MAX_TOKENS, StepLog())
    assert _lines(caplog) == {} and metrics.steps == []
    assert any("prompt 9 tokens" in rec.getMessage() for rec in caplog.records)


async def test_a_verify_steps_lookups_count_each_expert_its_rows_need_once(tiny_rads, caplog):
    """With 4 drafts per step (all right: replayed from a plain run), a step's 5 rows route 5 x k
    assignments per layer; the request's lookups count each distinct (layer, expert) of the step once."""
    caplog.set_level(logging.INFO, logger="radianced.requests")
    rad = tiny_rads["qwen3_moe"]
    prompt = prompts(rad.model.vocab_size, (20,), seed=44)
    base = moe_engine(rad)
    base.add(Request("r0", tuple(prompt[0]), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)))
    tokens = []
    while base.scheduler.has_unfinished:
        tokens += [t for ev in base.step() for t in ev.token_ids]

    def oracle(seq, n):
        return tuple(tokens[len(seq.token_ids) - len(prompt[0]):][:n])

    caplog.clear()
    cfg = Config(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, host_pool_mib=1, expert_slots=6,
                 speculative=4)
    engine = Engine.build(rad, cfg, Card.from_mib(256))
    engine.scheduler.drafting.policy = DraftPolicy(4, 0.0, adaptive=False, propose=oracle)
    metrics = await serve_greedy(engine, prompt, MAX_TOKENS, StepLog())
    rate, h, l, o, opct, r = _lines(caplog)["r0"]
    moe_layers, k = len(engine.experts.stats.lookups), rad.model.num_experts_per_tok
    decode = metrics.steps[1:]
    assert len(decode) == 2  # 7 tokens after the first: a step of 4 drafts (5 tokens), then one of 1 draft
    assert r == (5 + 2) * moe_layers * k  # every row routed, the rows of accepted drafts included
    assert l == sum(s[0] for s in decode) < r  # a step's rows share experts: each (layer, expert) once
    assert l >= len(decode) * moe_layers * k and o == l - h
