"""`--kv-cache-dtype fp8 | fp8_v4 | k6_v4` served by the engine on the card (issue 21): the check that
lifted each one's CUDA refusal.

tests/gpu/test_kv_quant_gpu.py checks the Triton kernels against the reference over a quantized cache (the
bytes each step writes, the attention each reads) on the three geometries. This runs the product's path
on the tiny families (`make_tiny` -> `convert` -> `Engine.build` on the card, `--deterministic`):
- eager: the build allocates the receipt's weights + state + arena within 1 MiB, the KV pages of a quantized
  block included (the receipt's per-token cost is what the pool holds);
- the same prompts with decode graphs serve the same greedy tokens as eager (the graphs capture the
  quantized write and reads), and a prefix-cache hit (the same prompts again) serves them once more.
"""

from __future__ import annotations

import gc

import pytest
import torch

from radianced.card import Card, MiB
from radianced.config import Config
from radianced.engine.engine import Engine
from radianced.kernels.kv_formats import KV_FORMATS
from radianced.model.convert import convert
from radianced.model.rad import RadFile
from radianced.model.tiny import make_tiny
from tests.engine.conftest import prompts, request, run_all
from tests.gpu.conftest import gpu_device, record

STEPS = 12


@pytest.fixture(scope="module", params=["llama", "qwen3_moe", "qwen3_next"])
def rad(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"kv_quant_{request.param}")
    convert(make_tiny(request.param, folder / "hf"), folder / "m.rad")
    r = RadFile.open(folder / "m.rad")
    yield r
    r.close()


def _serve(rad: RadFile, device: str, eager: bool, kv_dtype: str) -> tuple[list[dict], dict]:
    cfg = Config(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, deterministic=True,
                 enforce_eager=eager, kv_cache_dtype=kv_dtype)
    cuda = device == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    engine = Engine.build(rad, cfg, Card.from_mib(1024, cuda=cuda), device)
    r = engine.receipt
    numbers = {"kv_cache_dtype": kv_dtype, "eager": eager, "page_bytes": r.page_bytes}
    if cuda and eager:
        torch.cuda.synchronize()
        numbers |= {"allocated": torch.cuda.memory_allocated() - before,
                    "expected": r.held_bytes}
    ps = prompts(rad.model.vocab_size, (9, 33, 50), seed=21)
    runs = [run_all(engine, [request(engine, f"{k}{i}", p, max_tokens=STEPS, ignore_eos=True) for i, p in enumerate(ps)])
            for k in ("a", "b")]  # the second: the same prompts, their full blocks from the prefix cache
    engine.close()
    return [{rid[1:]: t for rid, t in run.items()} for run in runs], numbers


@pytest.mark.parametrize("kv_dtype", list(KV_FORMATS))
def test_quantized_kv_serves_on_the_card_with_the_receipts_allocation_and_graphs_equal_to_eager(rad, kv_dtype):
    device = gpu_device()
    eager, numbers = _serve(rad, device, True, kv_dtype)
    record({"test": "kv_quant_engine", "family": rad.model.family, "device": device, **numbers})
    if "allocated" in numbers:
        assert abs(numbers["allocated"] - numbers["expected"]) <= MiB, numbers
    graphs, _ = _serve(rad, device, False, kv_dtype)
    assert all(len(t) == STEPS for t in eager[0].values())
    assert eager[1] == eager[0], "a prefix-cache hit served other tokens"
    assert graphs == eager, "decode graphs served other tokens than eager"
