"""Engines over the tiny families with a small, fixed KV pool (no arena), for exact tests."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest
import torch

from radianced.config import Config
from radianced.engine.driver import AsyncEngine
from radianced.engine.engine import Engine
from radianced.engine.request import Request
from radianced.engine.sampling_params import SamplingParams
from radianced.kv.blocks import BlockAllocator
from radianced.model.convert import convert
from radianced.model.rad import RadFile
from radianced.model.tiny import make_tiny

FAMILIES = ("llama", "qwen3_moe", "qwen3_next")
BLOCK = 16


@pytest.fixture(scope="session")
def tiny_rads(tmp_path_factory) -> dict[str, RadFile]:
    rads = {}
    for family in FAMILIES:
        src = make_tiny(family, tmp_path_factory.mktemp(family))
        convert(src, src / "model.rad")
        rads[family] = RadFile.open(src / "model.rad")
    return rads


def small_engine(rad: RadFile, num_blocks: int = 64, max_num_seqs: int = 8, max_num_batched_tokens: int = 48,
                 seed: int = 0, speculative: int = 0) -> Engine:
    m = rad.model
    cfg = Config(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_queue=64,
                 speculative=speculative)
    layers = len(m.full_attention_layers) + (1 if cfg.drafts_with_mtp(m.num_mtp_layers) else 0)
    storage = torch.zeros((num_blocks, 1, layers, 2, BLOCK, m.num_key_value_heads, m.head_dim))
    return Engine.assemble(rad, cfg, storage, BlockAllocator.fixed(num_blocks, BLOCK), sampler_seed=seed)


def request(engine: Engine, rid: str, prompt: list[int], **params) -> Request:
    p = SamplingParams(**{"temperature": 0.0, "max_tokens": 12, **params})
    eos = frozenset() if p.ignore_eos else frozenset(engine.tokenizer.eos_token_ids)
    return Request(rid, tuple(prompt), p, frozenset(p.stop_token_ids) | eos)


def run_all(engine: Engine, requests: list[Request]) -> dict[str, list[int]]:
    """Add every request, step until all finish; the generated ids per request id."""
    for r in requests:
        engine.add(r)
    out: dict[str, list[int]] = defaultdict(list)
    while engine.scheduler.has_unfinished:
        for ev in engine.step():
            out[ev.request_id].extend(ev.token_ids)
    return dict(out)


def prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 3, (n,), generator=g).tolist() for n in lengths]  # no special tokens


async def serve_greedy(engine: Engine, ps: list[list[int]], max_tokens: int, metrics):
    """Every prompt of `ps` through the async driver at once (greedy, `ignore_eos`, request ids
    r0, r1, ...) to its end, reporting to `metrics`; returns `metrics`."""
    ae = AsyncEngine(engine, metrics)
    task = asyncio.create_task(ae.run())
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i, p):
        return [c async for c in ae.generate(p, params, request_id=f"r{i}")]

    await asyncio.gather(*(one(i, p) for i, p in enumerate(ps)))
    task.cancel()
    return metrics
