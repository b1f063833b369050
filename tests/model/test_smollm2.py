"""The real model: SmolLM2-135M-Instruct from its GGUF, ours against transformers (fp32)."""

from __future__ import annotations

import torch

from radianced.card import Card
from radianced.config import Config
from radianced.engine.engine import Engine
from radianced.kv.cache import KVCache
from radianced.model.loader import load_model
from radianced.model.rad import RadFile
from radianced.model.tokenizer import Tokenizer
from tests.engine.conftest import request, run_all
from tests.greedy import greedy_generate
from tests.oracle import reference_greedy

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
)
STEPS = 64


def test_greedy_64_tokens_identical_to_transformers_on_three_chat_prompts(smollm2_rad, smollm2_hf):
    with RadFile.open(smollm2_rad) as rad:
        tok = Tokenizer.from_header(rad.header)
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
        model = load_model(rad)
        cache = KVCache.allocate(rad.model, num_blocks=64, block_size=16, num_state_slots=3, dtype=torch.float32)
        ours = greedy_generate(model, cache, prompts, STEPS).tokens  # all three batched, no early stop
    for prompt, got in zip(prompts, ours):
        want, _ = reference_greedy(smollm2_hf, prompt, STEPS)
        assert got == want, f"first difference at token {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"


def test_the_engine_answers_paris(smollm2_rad):
    """The serving path (receipt, arena, scheduler, sampler) on the real model."""
    with RadFile.open(smollm2_rad) as rad:
        engine = Engine.build(rad, Config(max_model_len=512, max_num_seqs=2), Card.from_mib(1024))
        tok = engine.tokenizer
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
        out = run_all(engine, [request(engine, "paris", prompt, max_tokens=32)])["paris"]
    assert tok.decode(out) == "The capital of France is Paris."
    assert len(out) == 8  # seven text tokens and <|im_end|>
