"""Every family on tiny random weights against Hugging Face transformers (fp32, CPU).

The path under test is the product's: HF folder -> `radiancectl convert` -> .rad ->
`load_model`, with paged KV and a batch of three sequences (lengths 1, 17, 64)
prefilled together and decoded in lockstep for 32 steps.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from radianced.kv.cache import KVCache
from radianced.model.convert import convert
from radianced.model.loader import load_model
from radianced.model.rad import RadFile
from radianced.model.tiny import make_tiny
from tests.oracle import compare_prefill_rows, compare_with_reference

PROMPT_LENGTHS = (1, 17, 64)
STEPS = 32

CASES = {
    "llama": dict(family="llama"),
    "qwen3_moe": dict(family="qwen3_moe"),
    "qwen3_next": dict(family="qwen3_next"),
    # both layer kinds, in an order the default interval rule would not produce
    "qwen3_next_pattern": dict(family="qwen3_next", layer_types=["full_attention", "linear_attention",
                                                                  "linear_attention", "full_attention"]),
}


def _prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=list(CASES))
def tiny(request, tmp_path_factory):
    case = dict(CASES[request.param])
    family = case.pop("family")
    src = make_tiny(family, tmp_path_factory.mktemp(request.param), **case)
    dst = src / "model.rad"
    convert(src, dst)
    rad = RadFile.open(dst)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    yield rad, hf
    rad.close()


def test_prefill_and_decode_match_transformers(tiny):
    rad, hf = tiny
    model = load_model(rad)
    cache = KVCache.allocate(rad.model, num_blocks=64, block_size=16, num_state_slots=3, dtype=torch.float32)
    result = compare_with_reference(model, cache, hf, _prompts(rad.model.vocab_size), STEPS)
    assert result.worst_rel_err < 1e-4


def test_prefill_logits_of_every_prompt_row_match_transformers(tiny):
    rad, hf = tiny
    model = load_model(rad)
    cache = KVCache.allocate(rad.model, num_blocks=64, block_size=16, num_state_slots=3, dtype=torch.float32)
    assert compare_prefill_rows(model, cache, hf, _prompts(rad.model.vocab_size, seed=2)) < 1e-4
