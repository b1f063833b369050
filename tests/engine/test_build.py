"""Engine.build: the receipt is what gets allocated, and the model in arena pages is the model."""

from __future__ import annotations

import logging

import pytest

from radianced.card import Card
from radianced.config import Config
from radianced.engine.engine import Engine
from tests.engine.conftest import FAMILIES, prompts, request, run_all, small_engine


@pytest.mark.parametrize("family", FAMILIES)
def test_the_arena_is_the_receipts_elastic_line_and_serves_the_same_tokens(tiny_rads, family, caplog):
    rad = tiny_rads[family]
    cfg = Config(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=256)
    with caplog.at_level(logging.INFO, logger="radianced.engine"):
        engine = Engine.build(rad, cfg, Card.from_mib(256))
    receipt = engine.receipt
    arena_bytes = engine.arena.storage.numel()
    assert arena_bytes == receipt.arena_pages * receipt.page_bytes
    assert 0 <= receipt.elastic - arena_bytes < receipt.page_bytes  # within one page of the elastic line
    assert [r.getMessage() for r in caplog.records][:len(receipt.lines())] == receipt.lines()  # logged first
    if rad.header.experts:  # every expert sits in its own arena page (one slot each)
        assert engine.arena.held("experts") == len(rad.header.experts)
    ps = prompts(rad.model.vocab_size, (7, 29), seed=21)
    built = run_all(engine, [request(engine, f"b{i}", p) for i, p in enumerate(ps)])
    ref = run_all(small_engine(rad), [request(engine, f"b{i}", p) for i, p in enumerate(ps)])
    assert built == ref
