"""kv/cache.py over quantized blocks: a block is one contiguous piece of bytes, the receipt's block bytes
exactly, and the tiny families serve through the engine under every --kv-cache-dtype."""

from __future__ import annotations

import pytest
import torch

from radianced.card import Card
from radianced.config import Config
from radianced.engine.engine import Engine
from radianced.kernels.kv_formats import KV_FORMATS
from radianced.kv.cache import KVCache
from radianced.sizing import BLOCK_TOKENS, kv_block_bytes
from tests.engine.conftest import FAMILIES, prompts, request, run_all, tiny_rads  # noqa: F401 (the fixture)


@pytest.mark.parametrize("kv_dtype", list(KV_FORMATS))
def test_a_write_touches_only_its_blocks_bytes(kv_dtype):
    fmt = KV_FORMATS[kv_dtype]
    per = fmt.block_bytes(3, BLOCK_TOKENS, 2, 40)
    cache = KVCache(torch.zeros((5, 3, per), dtype=torch.uint8), (0, 2, 5), fmt=fmt, geometry=(BLOCK_TOKENS, 2, 40))
    for layer in (0, 2, 5):
        for plane in cache.layer(layer):
            plane.store(torch.tensor([7 * BLOCK_TOKENS, 7 * BLOCK_TOKENS + 15]), torch.ones((2, 2, 40)))
    touched = cache.storage.flatten(0, 1).any(-1).nonzero().flatten().tolist()
    assert touched == [7]  # block 7 = page 2, block 1: all three layers' codes and scales inside it


def test_a_bad_kv_dtype_is_named(tiny_rads):
    with pytest.raises(ValueError, match="kv cache dtype 'int3': choose auto, fp8, fp8_v4, k6_v4"):
        KVCache.allocate(tiny_rads["llama"].model, 4, BLOCK_TOKENS, 0, torch.float32, kv_dtype="int3")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kv_dtype", list(KV_FORMATS))
def test_the_engine_serves_every_family_under_every_kv_dtype_with_the_receipts_bytes(tiny_rads, family, kv_dtype):
    """The receipt's block bytes are the storage's; a second request with the same prompt hits the prefix
    cache, reads the cached quantized blocks as they are (their bytes unchanged) and gives the same tokens."""
    rad = tiny_rads[family]
    m = rad.model
    engine = Engine.build(rad, Config(max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64,
                                      kv_cache_dtype=kv_dtype), Card.from_mib(256))
    group = engine.receipt.groups[0]
    cache = engine.runner.cache
    assert cache.dtype_name == kv_dtype and kv_dtype in group.dtype
    assert group.block_bytes == cache.storage.shape[-1] == kv_block_bytes(m, len(m.full_attention_layers), kv_dtype, 4)
    assert f"in {kv_dtype}: {KV_FORMATS[kv_dtype].describe}" in " ".join(engine.receipt.lines())
    prompt = prompts(m.vocab_size, (37,), seed=5)[0]
    first = run_all(engine, [request(engine, "a", prompt, max_tokens=6)])["a"]
    cached = [b[0] for b, _ in engine.scheduler.prefix.cached_blocks()]  # the prompt's two full blocks
    assert len(cached) == 2
    before = cache.storage.flatten(0, 1)[cached].clone()
    seq = engine.add(request(engine, "b", prompt, max_tokens=6))
    second = run_all(engine, [])["b"]
    assert seq.num_cached_blocks >= 2 and second == first
    assert torch.equal(cache.storage.flatten(0, 1)[cached], before)  # read as they are, never re-quantized
