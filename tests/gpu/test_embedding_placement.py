"""`--embedding-placement ram` on the GPU: the table pinned in host RAM, its rows read in the step.

- The gather kernel reads a table registered in place (the loader's pinning) inside a
  captured CUDA graph: each replay with new ids on the card gives torch's rows, bit for
  bit. Its time per call against F.embedding from a table on the card is recorded.
- A whole engine (decode graphs on, `--deterministic`) serves the same greedy tokens with
  the table in host RAM as on the card, on the untied families; under `ram` the table is
  pinned host memory and the weights on the card are smaller by exactly its bytes.

With RADIANCED_GPU_TEST_DEVICE=cpu the engine test is a dry run (the CPU backend keeps the
table where it is under either flag); the kernel test needs CUDA.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.nn.functional as F

from radianced.card import Card
from radianced.config import Config
from radianced.engine.engine import Engine
from radianced.kernels.pinned import register_pinned
from radianced.model.loader import EMBEDDINGS
from tests.engine.conftest import prompts, request, run_all, tiny_rads  # noqa: F401 (fixture)
from tests.gpu.conftest import gpu_device, record


class _Owner:
    """Holds the registration of a test table (unpinned when collected)."""


def _timed(fn, iters: int = 200) -> float:
    """Microseconds per call of fn (replays of a graph), after one warm call."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


@pytest.fixture(scope="module")
def pinned_table():
    """Qwen3-30B-A3B's table shape (593.5 MiB of bf16) registered in place, and its copy on the card."""
    if gpu_device() != "cuda":
        pytest.skip("reads host memory from a CUDA kernel")
    table = torch.randn((151936, 2048), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    owner = _Owner()
    owner.unpin = register_pinned(owner, table, table)
    yield table, table.cuda()
    owner.unpin()


@pytest.mark.parametrize("tokens", [1, 8, 256])
def test_gather_from_pinned_host_rows_inside_a_cuda_graph(pinned_table, tokens):
    from radianced.kernels.embedding import gather_rows

    table, on_card = pinned_table
    g = torch.Generator().manual_seed(tokens)
    ids = torch.zeros(tokens, dtype=torch.int64, device="cuda")
    gather_rows(table, ids)  # compile outside the capture
    graph, eager_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()  # eager: F.embedding, captured
    with torch.cuda.graph(graph):
        out = gather_rows(table, ids)
    with torch.cuda.graph(eager_graph):
        ref = F.embedding(ids, on_card)
    for trial in range(3):
        new = torch.randint(0, table.shape[0], (tokens,), generator=g)
        new[-1] = new[0]  # a repeated id
        ids.copy_(new)
        graph.replay()
        eager_graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), F.embedding(new, table)), f"replay {trial}"
        assert torch.equal(out, ref), f"replay {trial}: the rows of the table on the card"
    host_us, card_us = _timed(graph.replay), _timed(eager_graph.replay)
    record({"test": "embedding_gather", "tokens": tokens, "hidden": 2048, "dtype": "bf16",
            "host_table_us": host_us, "card_table_us": card_us})


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_the_engine_serves_the_same_tokens_with_the_table_in_host_ram(tiny_rads, family):  # noqa: F811
    device, rad = gpu_device(), tiny_rads[family]
    assert not rad.model.tie_word_embeddings
    tokens, placed = {}, {}
    for placement in ("vram", "ram"):
        cfg = Config(embedding_placement=placement, deterministic=True, max_model_len=256, max_num_seqs=4,
                     max_num_batched_tokens=64)
        engine = Engine.build(rad, cfg, Card.from_mib(2048, cuda=device == "cuda"), device)
        table = engine.runner.model.embed.weight
        host_lines = [line for line in engine.receipt.lines() if line.startswith("host RAM embeddings")]
        assert bool(host_lines) == (placement == "ram")
        if device == "cuda":
            assert (table.device.type == "cpu") == (placement == "ram")
            assert table.is_pinned() or placement == "vram"
        reqs = [request(engine, f"r{i}", p, max_tokens=16) for i, p in enumerate(prompts(rad.model.vocab_size,
                                                                                          [1, 5, 37, 64]))]
        tokens[placement] = run_all(engine, reqs)
        placed[placement] = engine.runner.model.placed
        engine.close()
        del engine, table
        gc.collect()  # the arena goes back before the next build reads the card
    assert tokens["ram"] == tokens["vram"]
    if device == "cuda":
        table_bytes = rad.tensor_entry(EMBEDDINGS).nbytes
        assert placed["vram"].device_bytes - placed["ram"].device_bytes == table_bytes == placed["ram"].host_bytes
    record({"test": "embedding_placement_engine", "family": family, "same_tokens": True,
            "placed": {k: [v.device_bytes, v.host_bytes] for k, v in placed.items()}})
