"""The Triton router against the reference: `route` (softmax, top-k, renormalization) against
`reference.route`, and the one-launch `router` at T = 1 against the two launches it replaces.

Without CUDA the kernels run in Triton's interpreter on CPU tensors. `route`: expert counts
60 (not a power of two), 128 (Qwen3-MoE) and 512 (Qwen3-Next); T = 1, 15, 63, 300.
The ids must be the reference's, in its order; weights within 1e-4 (fp32 out) or
1e-2 (bf16 out) of the fp32 reference. `router` at T = 1 (the gemv's RMSNorm and
projection, then the route, in one launch): the ids, weights and normed row of
`linear.linear(..., keep_normed=True)` then `route`, bit for bit, for bf16 and fp32,
E = 60, 100, 128, top-k 1, 2, 8, with tied and near-tied logits among the top ones.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import rand, require_interpreted  # before triton loads
from tests.kernels.compare import rel_err

from radianced.kernels import arrival, linear, reference, router

require_interpreted(router._route_kernel, "router")


@pytest.mark.parametrize("t", [1, 15, 63, 300])
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


@pytest.mark.parametrize("top_k,experts", [(0, 8), (9, 8), (2, 2048)])
def test_refuses_what_one_program_cannot_route(top_k, experts):
    with pytest.raises(ValueError, match="top_k"):
        router.route(rand(1, experts), top_k, True, torch.float32)


HIDDEN = 64  # small: the interpreter runs the gemv's E / 2 programs one by one


def _router_operands(experts: int, dtype: torch.dtype, seed: int = 0, zero_centred: bool = False):
    """x [1, HIDDEN] and a norm; the weight [E, HIDDEN] with rows 3 and 5 and the last equal to
    the normed x (scaled to the top logits: ties), row 9 a hair larger (near-tie, a tie once rounded
    to bf16) and row 1 a hair smaller."""
    x = rand(1, HIDDEN, dtype=dtype, seed=seed, scale=3.0)
    norm = (rand(HIDDEN, dtype=dtype, seed=seed + 1, scale=0.2), 1e-6, zero_centred)
    w = rand(experts, HIDDEN, dtype=dtype, seed=seed + 2, scale=HIDDEN ** -0.5)
    top = reference.rms_norm(x, *norm)[0] * (3.0 / reference.rms_norm(x, *norm).float().norm())
    w[[3, 5, experts - 1]] = top
    w[9], w[1] = top * (1 + 2 ** -10), top * (1 - 2 ** -10)
    return x, w, norm


def _two_launches(x, w, norm, top_k, renormalize):
    """((ids, weights, normed x) of the gemv with the norm then `route`, the logits [1, E] between)."""
    logits, normed = linear.linear(x, w, norm=norm, keep_normed=True)
    return (*router.route(logits, top_k, renormalize, x.dtype), normed), logits


def _assert_identical(got, want):
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("experts", [60, 100, 128])
@pytest.mark.parametrize("top_k,renormalize", [(1, False), (2, True), (8, True), (8, False)])
def test_one_launch_router_is_the_two_launches_bit_for_bit(monkeypatch, dtype, experts, top_k, renormalize):
    x, w, norm = _router_operands(experts, dtype)
    want, logits = _two_launches(x, w, norm, top_k, renormalize)
    monkeypatch.setattr(router, "_route_kernel", None)  # T = 1 must not launch the route kernel
    got = router.router(x, w, norm, top_k, renormalize, dtype)
    _assert_identical(got, want)
    row = logits[0].tolist()
    assert got[0][0].tolist() == sorted(range(experts), key=lambda i: (-row[i], i))[:top_k]  # ties: lower id
    assert row[3] == row[5] and (top_k < 8 or {1, 3, 5, 9, experts - 1} <= set(got[0][0].tolist()))


@pytest.mark.parametrize("norm_kind", ["none", "zero_centred"])
def test_one_launch_router_without_a_norm_and_zero_centred(norm_kind):
    x, w, norm = _router_operands(128, torch.bfloat16, seed=5, zero_centred=True)
    norm = None if norm_kind == "none" else norm
    got = router.router(x, w, norm, 8, True, torch.bfloat16)
    _assert_identical(got, _two_launches(x, w, norm, 8, True)[0])
    if norm is None:
        assert got[2] is x


def test_one_launch_router_twice_in_a_row_resets_its_counter():
    """A launch leaves its arrival counter at zero: the next one's last program routes again
    (a counter left at E / 2 would leave the second launch's ids unwritten)."""
    for seed in (11, 12):
        x, w, norm = _router_operands(128, torch.bfloat16, seed=seed)
        _assert_identical(router.router(x, w, norm, 8, True, torch.bfloat16), _two_launches(x, w, norm, 8, True)[0])
        assert int(arrival.counters(x.device, 1)[0]) == 0


def test_router_above_one_row_is_linear_then_route():
    """T = 3 (the tile kernel, then `route`): the reference's ids, weights within 1e-4."""
    x, w, norm = rand(3, HIDDEN, seed=2), rand(60, HIDDEN, seed=3), (rand(HIDDEN, seed=4), 1e-6, False)
    ids, weights, normed = router.router(x, w, norm, 4, True, torch.float32)
    want_ids, want_weights, want_normed = reference.router(x.cpu(), w.cpu(), tuple(
        a.cpu() if isinstance(a, torch.Tensor) else a for a in norm), 4, True, torch.float32)
    assert torch.equal(ids.cpu(), want_ids)
    assert rel_err(weights.cpu(), want_weights) < 1e-4 and rel_err(normed.cpu(), want_normed) < 1e-4


@pytest.mark.parametrize("top_k,experts", [(9, 8), (2, 2048)])
def test_router_refuses_what_one_program_cannot_route(top_k, experts):
    with pytest.raises(ValueError, match="top_k"):
        router.router(rand(1, 16), rand(experts, 16), None, top_k, True, torch.float32)
