"""SmolLM2's Q4_1 GGUF converted with its blocks kept compact, against transformers' fp32 load of the same file.

transformers dequantizes the GGUF at load; ours keeps the Q4_1 (and Q8_0) bytes in
memory. The reference ops dequantize each matrix per use with the bit-exact reference
dequantizers; the host backend's block kernels read the same values from the blocks in
place (kernels/cpu_blocks.py), the tied Q8_0 lm_head included. Both agree with transformers
to fp32 rounding (1e-4 of max |logit|), and greedy decoding is identical for 64 tokens.
"""

from __future__ import annotations

import pytest
import torch

from radianced.kernels.compact import CompactWeight
from radianced.kv.cache import KVCache
from radianced.model.gguf import convert_gguf
from radianced.model.loader import load_model
from radianced.model.rad import RadFile
from radianced.model.tokenizer import Tokenizer
from tests.oracle import compare_with_reference

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"
STEPS = 64


@pytest.fixture(scope="module")
def smollm2_compact(smollm2_gguf, tmp_path_factory):
    dst = tmp_path_factory.mktemp("smollm2c") / "smollm2-q4_1.rad"
    convert_gguf(smollm2_gguf, dst, None, compact=True)
    return dst


def test_the_q4_1_blocks_stay_compact_in_the_file_and_in_memory(smollm2_compact, smollm2_gguf):
    with RadFile.open(smollm2_compact) as rad:
        formats = {t.dtype for t in rad.header.tensors}
        assert "q4_1" in formats and not formats & {"f16", "bf16"}
        model = load_model(rad)
        assert isinstance(model.layers[0].mlp.gate, CompactWeight) and model.layers[0].mlp.gate.fmt == "q4_1"
        assert isinstance(model.embed.weight, CompactWeight) and model.lm_head.weight is model.embed.weight
    assert smollm2_compact.stat().st_size < smollm2_gguf.stat().st_size * 1.1  # ~98 MB, not 515 MiB


@pytest.mark.parametrize("oracle", [True, False], ids=["reference-ops", "host-blocks"])
def test_logits_and_64_greedy_tokens_match_transformers(smollm2_compact, smollm2_hf, request, oracle):
    if oracle:
        request.getfixturevalue("oracle_ops")
    with RadFile.open(smollm2_compact) as rad:
        tok = Tokenizer.from_header(rad.header)
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))
        model = load_model(rad)
        cache = KVCache.allocate(rad.model, num_blocks=16, block_size=16, num_state_slots=1, dtype=torch.float32)
        result = compare_with_reference(model, cache, smollm2_hf, [prompt], STEPS, tol=1e-4)
    assert result.ties == 0  # every greedy token equal, none excused as a tie


def test_the_engine_serves_the_compact_model(smollm2_compact):
    """The serving path (receipt, arena, scheduler, sampler) on the Q4_1 blocks kept compact."""
    from radianced.card import Card
    from radianced.config import Config
    from radianced.engine.engine import Engine
    from tests.engine.conftest import request, run_all

    with RadFile.open(smollm2_compact) as rad:
        engine = Engine.build(rad, Config(max_model_len=512, max_num_seqs=2), Card.from_mib(1024))
        tok = engine.tokenizer
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))
        out = run_all(engine, [request(engine, "paris", prompt, max_tokens=32)])["paris"]
    assert tok.decode(out) == "The capital of France is Paris."
