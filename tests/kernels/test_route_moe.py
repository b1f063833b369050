"""`route_moe` (kernels/moe.py): `route` then `moe`, the route launch folded into the experts'
gate/up launch at T == 1, against the unfused Triton ops and the fp32 reference.

Without CUDA the kernels run in Triton's interpreter on CPU tensors. Shapes as in
test_moe.py (H = 72, I = 40, spare slab rows behind a permuted table), with 8, 60
(not a power of two) and 128 (Qwen3-MoE) experts. The ids and weights must be
`route`'s and the output `moe`'s on them, bit for bit; the ids also the exact
order (`ranked`: logit descending, ties to the lower id); the output within
1e-4 (fp32) or 1e-2 (bf16) of the fp32 reference.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import DEVICE, require_interpreted  # before triton loads
from tests.kernels.compare import rel_err

from radianced.kernels import moe as moe_kernels
from radianced.kernels import reference, router

require_interpreted(moe_kernels._moe_gate_up_kernel, "moe")

H, I = 72, 40
SPARE = 3  # slab rows no expert uses


def ranked(logits: torch.Tensor) -> list[int]:
    """One row's experts in routing order: logit descending, ties to the lower id, NaN as -inf."""
    values = [float("-inf") if v != v else v for v in logits.float().tolist()]
    return sorted(range(len(values)), key=lambda e: (-values[e], e))


class Layer:
    """x, router logits and E experts in a slab with spare rows behind a permuted table."""

    def __init__(self, experts: int, t: int = 1, dtype: torch.dtype = torch.float32, seed: int = 0,
                 logits: torch.Tensor | None = None):
        g = torch.Generator().manual_seed(seed)
        self.slab = (torch.randn((experts + SPARE, 3 * I * H), generator=g) * H ** -0.5).to(dtype).to(DEVICE)
        self.table = torch.randperm(experts + SPARE, generator=g)[:experts].to(DEVICE)
        self.x = torch.randn((t, H), generator=g).to(dtype).to(DEVICE)
        if logits is None:
            logits = torch.randn((t, experts), generator=g) * 2.0
        self.logits = logits.to(dtype).to(DEVICE)
        self.host = None

    def fused(self, top_k: int, renormalize: bool, **kw) -> tuple[torch.Tensor, ...]:
        got = moe_kernels.route_moe(self.x, self.logits, top_k, renormalize, self.table, self.slab, I, self.host,
                                    **kw)
        return tuple(t.cpu() for t in got)

    def unfused(self, top_k: int, renormalize: bool, **kw) -> tuple[torch.Tensor, ...]:
        """`route` then `moe`: the launches the fused op replaces."""
        ids, weights = router.route(self.logits, top_k, renormalize, self.x.dtype)
        out = moe_kernels.moe(self.x, ids, weights, self.table, self.slab, I, self.host, **kw)
        return out.cpu(), ids.cpu(), weights.cpu()

    def reference(self, ids: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor | None = None):
        """The fp32 reference MoE on the given routing (the same bf16 values)."""
        f = lambda t: None if t is None else t.float().cpu()  # noqa: E731
        return reference.moe(f(self.x), ids.cpu(), f(weights), self.table.cpu(), f(self.slab), I, f(self.host),
                             residual=f(residual))


def assert_is_route_then_moe(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    out, ids, weights = got
    assert ids.dtype == torch.int64 and weights.dtype == want[2].dtype and out.dtype == want[0].dtype
    assert torch.equal(ids, want[1]), (ids, want[1])
    assert torch.equal(weights, want[2]), (weights, want[2])
    assert torch.equal(out, want[0])


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "softmax"])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("experts", [8, 60, 128])
def test_batch_1_routes_in_the_gate_up_launch_as_route_does(experts, top_k, renormalize):
    """fp32: `route` + `moe`'s bits; the reference's ids, weights within 1e-4, output within 1e-4."""
    layer = Layer(experts, seed=experts + top_k)
    got = layer.fused(top_k, renormalize)
    assert_is_route_then_moe(got, layer.unfused(top_k, renormalize))
    out, ids, weights = got
    assert ids[0].tolist() == ranked(layer.logits[0])[:top_k]
    want_out, want_ids, want_weights = reference.route_moe(
        layer.x.cpu(), layer.logits.cpu(), top_k, renormalize, layer.table.cpu(), layer.slab.cpu(), I)
    assert torch.equal(ids, want_ids)
    assert rel_err(weights, want_weights) < 1e-4
    assert rel_err(out, want_out) < 1e-4


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "softmax"])
@pytest.mark.parametrize("experts,top_k", [(60, 2), (128, 8)])
def test_bf16_logits_route_as_route_does(experts, top_k, renormalize):
    """The model's case: bf16 logits (they tie often), x and experts. The ids are the exact order's,
    ties to the lower id; the output within 1e-2 of the fp32 reference on the same routing."""
    layer = Layer(experts, dtype=torch.bfloat16, seed=7 + experts)
    got = layer.fused(top_k, renormalize)
    assert_is_route_then_moe(got, layer.unfused(top_k, renormalize))
    out, ids, weights = got
    assert ids[0].tolist() == ranked(layer.logits[0])[:top_k]
    assert rel_err(out, layer.reference(ids, weights)) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_exact_ties_go_to_the_lower_expert_id(dtype):
    """60 logits of four values, 15 experts each (2 at ids 1, 5, 9, ...): the top 8 are the lowest
    ids among the largest, with equal weights."""
    logits = torch.tensor([[(3 * e) % 4 - 1.0 for e in range(60)]])
    layer = Layer(60, dtype=dtype, seed=3, logits=logits)
    got = layer.fused(8, True)
    assert_is_route_then_moe(got, layer.unfused(8, True))
    out, ids, weights = got
    assert ids[0].tolist() == ranked(logits[0])[:8] == [1, 5, 9, 13, 17, 21, 25, 29]
    assert torch.equal(weights.float(), torch.full((1, 8), 1 / 8))
    assert rel_err(out, layer.reference(ids, weights)) < (1e-4 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "softmax"])
def test_nan_and_minus_infinity_logits_count_below_every_number(renormalize):
    """A NaN logit counts as -inf (the reference's softmax is all NaN: nothing to match); with fewer
    numbers than k the -inf experts follow in id order, k distinct ones, weight 0."""
    logits = torch.full((1, 60), float("-inf"))
    logits[0, [5, 40, 17]] = torch.tensor([1.0, 3.0, 2.0])
    logits[0, [0, 41, 59]] = float("nan")
    layer = Layer(60, seed=4, logits=logits)
    got = layer.fused(6, renormalize)
    assert_is_route_then_moe(got, layer.unfused(6, renormalize))
    out, ids, weights = got
    assert ids[0].tolist() == [40, 17, 5, 0, 1, 2]
    assert torch.isfinite(weights).all() and weights[0, 3:].eq(0).all()
    assert rel_err(out, layer.reference(ids, weights)) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_residual_is_added_as_moe_adds_it(dtype):
    layer = Layer(60, dtype=dtype, seed=5)
    residual = torch.randn((1, H), generator=torch.Generator().manual_seed(6)).to(dtype).to(DEVICE)
    got = layer.fused(8, True, residual=residual)
    assert_is_route_then_moe(got, layer.unfused(8, True, residual=residual))
    out, ids, weights = got
    assert rel_err(out, layer.reference(ids, weights, residual)) < (1e-4 if dtype == torch.float32 else 1e-2)


def test_negative_entries_read_the_host_pool():
    """tiers/slab.py's table: entry >= 0 a slab row, entry < 0 host row -1 - entry."""
    layer = Layer(60, seed=8)
    g = torch.Generator().manual_seed(9)
    layer.host = (torch.randn((40, 3 * I * H), generator=g) * H ** -0.5).to(DEVICE)
    if DEVICE == "cuda":
        layer.host = layer.host.cpu().pin_memory()  # the kernels read it over the link
    layer.table[::2] = -1 - torch.randperm(40, generator=g)[:30].to(DEVICE)
    got = layer.fused(8, True)
    assert_is_route_then_moe(got, layer.unfused(8, True))
    out, ids, weights = got
    assert (layer.table.cpu()[ids] < 0).any() and (layer.table.cpu()[ids] >= 0).any()
    assert rel_err(out, layer.reference(ids, weights)) < 1e-4


@pytest.mark.parametrize("tokens,experts,route_launches", [
    (1, 60, 0), (5, 60, 1), (1, moe_kernels.ROUTE_FUSED_MAX_EXPERTS, 0), (1, 512, 1)])
def test_only_batch_1_with_a_small_router_routes_inside_the_experts_launch(monkeypatch, tokens, experts,
                                                                            route_launches):
    """Batches (T > 1) and routers over ROUTE_FUSED_MAX_EXPERTS take `route` then `moe` (the grouped
    path for T > 1): the same bits either way."""
    layer = Layer(experts, t=tokens, seed=10)
    want = layer.unfused(4, True, deterministic=True)
    calls = []

    def counted(*args, **kw):
        calls.append(args)
        return route(*args, **kw)

    route = router.route
    monkeypatch.setattr(router, "route", counted)
    assert_is_route_then_moe(layer.fused(4, True, deterministic=True), want)
    assert len(calls) == route_launches


def test_inputs_it_cannot_route_are_refused_with_the_numbers():
    layer = Layer(8, seed=11)
    x, table, slab = layer.x, layer.table, layer.slab
    wider = torch.zeros((1, 9), device=DEVICE)
    with pytest.raises(ValueError, match=r"logits must be \[T, E\] = \[1, 8\]"):
        moe_kernels.route_moe(x, wider, 2, True, table, slab, I)
    with pytest.raises(ValueError, match=r"logits must be \[T, E\] = \[1, 8\]"):
        moe_kernels.route_moe(x, torch.zeros((2, 8), device=DEVICE), 2, True, table, slab, I)
    with pytest.raises(ValueError, match="contiguous rows"):
        moe_kernels.route_moe(x, torch.zeros((1, 16), device=DEVICE)[:, ::2], 2, True, table, slab, I)
    for top_k in (0, 9):
        with pytest.raises(ValueError, match=rf"top_k {top_k} must be in \[1, E=8\]"):
            moe_kernels.route_moe(x, layer.logits, top_k, True, table, slab, I)
    with pytest.raises(ValueError, match="table must be"):
        moe_kernels.route_moe(x, layer.logits, 2, True, table.int(), slab, I)
    with pytest.raises(ValueError, match=r"slab must be \[R, 3 \* I \* H\]"):
        moe_kernels.route_moe(x, layer.logits, 2, True, table, slab, I + 1)
