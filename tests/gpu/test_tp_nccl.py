"""`--tp 2` over NCCL, one process a card (cuda:0, cuda:1): the tiny families' greedy tokens equal
one card's and their logits within fp32 rounding. Needs 2 GPUs (nvidia-h200-x2); skipped on fewer.
The CPU proof over gloo is tests/engine/test_tp_workers.py's; this is the same forward on NCCL."""

from __future__ import annotations


import pytest
import torch
import torch.multiprocessing as mp

from radianced.engine.tp_processes import free_port
from radianced.kernels import ops
from radianced.kv.cache import KVCache
from radianced.model.convert import convert
from radianced.model.loader import load_model
from radianced.model.rad import RadFile
from radianced.model.tiny import FAMILIES, make_tiny
from tests.gpu.conftest import record
from tests.greedy import greedy_generate

PROMPTS = [[5, 9, 33, 100, 7, 8, 200, 3], [40, 41], list(range(1, 40))]
TOKENS = 16

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _greedy(model, device):
    cache = KVCache.allocate(model.cfg, 64, 16, len(PROMPTS), torch.float32, device)
    return greedy_generate(model, cache, PROMPTS, TOKENS)


def _rank(rank: int, port: int, path: str, out) -> None:
    from radianced.model.parallel import ProcessGroup
    from radianced.model.sharded_loader import load_shard

    device = torch.device(f"cuda:{rank}")
    group = ProcessGroup.join(rank, 2, f"127.0.0.1:{port}", device)
    ops.select(device)
    trace = _greedy(load_shard(RadFile.open(path), group, device), device)
    if rank == 0:
        out.put((trace.tokens, trace.logits))
    group.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_over_nccl_gives_one_cards_tokens(tmp_path, family):
    src = make_tiny(family, tmp_path / family)
    convert(src, src / "model.rad")
    ops.select("cuda")
    one = _greedy(load_model(RadFile.open(src / "model.rad"), "cuda"), "cuda")
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(r, port, str(src / "model.rad"), out)) for r in range(2)]
    for p in ranks:
        p.start()
    tokens, logits = out.get(timeout=120)
    for p in ranks:
        p.join(timeout=60)
    diff = max((a - b).abs().max().item() for a, b in zip(logits, one.logits))
    record({"test": "tp_nccl", "family": family, "max_logit_diff": diff, "tokens_equal": tokens == one.tokens})
    assert tokens == one.tokens
    assert diff <= 1e-4, f"{family}: --tp 2 logits differ from one card's by {diff}"
