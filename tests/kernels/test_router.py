"""The Triton router (softmax, top-k, renormalization) against `reference.route`.

Without CUDA the kernel runs in Triton's interpreter on CPU tensors. Expert counts
60 (not a power of two), 128 (Qwen3-MoE) and 512 (Qwen3-Next); T = 1, 15, 63, 130 (a program a token).
The ids must be the reference's, in its order; weights within 1e-4 (fp32 out) or
1e-2 (bf16 out) of the fp32 reference.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import DEVICE, rand, require_interpreted  # before triton loads
from tests.kernels.compare import rel_err

from radianced.kernels import reference, router

require_interpreted(router._route_kernel, "router")


@pytest.mark.parametrize("t", [1, 15, 63, 130])
@pytest.mark.parametrize("experts,top_k", [(60, 4), (128, 8), (512, 10)])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "softmax"])
def test_route_matches_reference(t, experts, top_k, renormalize):
    logits = rand(t, experts, seed=t + experts, scale=2.0)
    ids, weights = router.route(logits, top_k, renormalize, torch.float32)
    want_ids, want_weights = reference.route(logits.cpu(), top_k, renormalize, torch.float32)
    assert ids.dtype == torch.int64 and ids.shape == (t, top_k)
    assert torch.equal(ids.cpu(), want_ids)
    assert rel_err(weights.cpu(), want_weights) < 1e-4


def test_bf16_logits_give_bf16_weights_of_the_fp32_softmax():
    """The model's case: bf16 router logits, weights in the activation dtype. bf16 logits tie
    often, and torch.topk breaks ties its own way: the picks must be k distinct experts holding
    the k largest logits, in descending order, with the reference's weights."""
    logits = rand(33, 128, dtype=torch.bfloat16, seed=7, scale=2.0)
    ids, weights = router.route(logits, 8, True, torch.bfloat16)
    _, want_weights = reference.route(logits.cpu().float(), 8, True, torch.float32)
    ids, picked = ids.cpu(), logits.cpu().float().gather(1, ids.cpu())
    assert weights.dtype == torch.bfloat16
    assert all(len(set(row)) == 8 for row in ids.tolist())
    assert torch.equal(picked, logits.cpu().float().topk(8, dim=-1).values)
    assert rel_err(weights.cpu().float(), want_weights) < 1e-2


def test_ties_go_to_the_lower_expert_id():
    logits = torch.zeros(2, 16, device=rand(1).device)
    ids, weights = router.route(logits, 3, True, torch.float32)
    assert ids.cpu().tolist() == [[0, 1, 2], [0, 1, 2]]
    assert torch.allclose(weights.cpu(), torch.full((2, 3), 1 / 3))


def test_experts_at_minus_infinity_are_never_picked_twice():
    """Regression: the arg-max rounds marked a picked expert -inf, so once the best logit left was
    -inf a round picked the lowest such expert again ([3, 0, 0] here). Now the -inf experts follow
    in id order, k distinct ones, with weight 0."""
    logits = torch.full((1, 8), float("-inf"), device=DEVICE)
    logits[0, 3] = 0.0
    ids, weights = router.route(logits, 3, True, torch.float32)
    assert ids.cpu().tolist() == [[3, 0, 1]]
    assert weights.cpu().tolist() == [[1.0, 0.0, 0.0]]


def test_a_nan_logit_counts_as_minus_infinity():
    """torch's softmax makes a row with a NaN all NaN; the kernel routes around the NaN expert."""
    logits = torch.tensor([[float("nan"), 1.0, 2.0, 0.5]], device=DEVICE)
    ids, weights = router.route(logits, 2, True, torch.float32)
    assert ids.cpu().tolist() == [[2, 1]]
    assert rel_err(weights.cpu(), torch.tensor([[2.0, 1.0]]).softmax(-1)) < 1e-6


@pytest.mark.parametrize("top_k,experts", [(0, 8), (9, 8), (2, 2048)])
def test_refuses_what_one_program_cannot_route(top_k, experts):
    with pytest.raises(ValueError, match="top_k"):
        router.route(rand(1, experts), top_k, True, torch.float32)
