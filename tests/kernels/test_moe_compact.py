"""The Triton pointer-table MoE on compact expert extents (kernels/weight_tiles.py `weight_tile`) against
`reference.moe` over the same bytes.

Without CUDA the kernels run in Triton's interpreter on CPU tensors, so shapes stay small: H = 96
(under one 128-wide reduction step, or 3 of a 256-wide step's 8 GGUF blocks: masked), I = 160 (two
fp8 scale blocks along I; three 64-wide column blocks or five 32-wide ones, the last 64-wide one
partial; down's K steps 128 + 32 wide, or 5 of 8 blocks), E = 6 experts in a uint8 slab with spare rows behind a
permuted table, some experts in host rows. Extents are written as the converters write them:
`gguf.quants.quantize` blocks (q8_0, q4_0, q4_1) and HF-style fp8 with 128 x 128 block scales.
fp32 activations within 1e-4 of max|ref|; where a format's dequantization is a bare product (q8_0,
q4_0, fp8_b128) the kernel equals, bit for bit, the same kernel over the dequantized fp32 slab.
"""

from __future__ import annotations

import sys

import gguf
import pytest
import torch

from tests.kernels.interpreter import DEVICE, require_interpreted  # before triton loads
from tests.kernels.compare import rel_err

from radianced.kernels import moe as moe_kernels
from radianced.kernels import reference, router
from radianced.kernels.compact import CompactWeight
from radianced.kernels.formats import expert_formats
from radianced.model.quantize import quantize

require_interpreted(moe_kernels._moe_gate_up_kernel, "moe")

E, H, I = 6, 96, 160
SPARE = 2
HOST_EXPERTS = {1: 0, 4: 2}  # expert -> host row


def _compact(w: torch.Tensor, fmt: str) -> CompactWeight:
    if fmt == "q4_1":  # not a --quantize scheme; a GGUF's Q4_1 blocks, as gguf writes them
        return CompactWeight(fmt, tuple(w.shape), torch.from_numpy(
            gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1)))
    return quantize(w, fmt)


class CompactExperts:
    """E experts of one format: a byte slab (rows a little wider than an extent, 16-byte aligned), a host
    pool holding HOST_EXPERTS, the same experts dequantized (fp32, for the plain kernel), and a routing."""

    def __init__(self, fmt: str, t: int, k: int = 2, dtype: torch.dtype = torch.float32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        gate_up, down = expert_formats(fmt)
        extents, dense = [], []
        for _ in range(E):
            pieces = [_compact(torch.randn(s, generator=g) * H ** -0.5, f)
                      for s, f in (((I, H), gate_up), ((I, H), gate_up), ((H, I), down))]
            extents.append(torch.cat([p.data.reshape(-1) for p in pieces]))
            dense.append(torch.cat([p.dequantize().reshape(-1) for p in pieces]))
        width = (extents[0].numel() + 16 + 15) // 16 * 16
        self.fmt, self.extent_bytes = fmt, extents[0].numel()
        self.table = torch.randperm(E + SPARE, generator=g)[:E]
        slab = torch.full((E + SPARE, width), 0xFF, dtype=torch.uint8)  # bytes past an extent are never read
        dense_slab = torch.full((E + SPARE, 3 * I * H), float("nan"))
        self.host = torch.full((max(HOST_EXPERTS.values()) + 1, width), 0xFF, dtype=torch.uint8)
        for e in range(E):
            slab[self.table[e], :self.extent_bytes] = extents[e]
            dense_slab[self.table[e]] = dense[e]
            if e in HOST_EXPERTS:
                self.host[HOST_EXPERTS[e], :self.extent_bytes] = extents[e]
        self.slab, self.dense_slab = slab.to(DEVICE), dense_slab.to(DEVICE)
        self.host = self.host.to(DEVICE)
        self.mixed = self.table.clone()  # HOST_EXPERTS read from the host rows, the rest from the slab
        for e, row in HOST_EXPERTS.items():
            self.mixed[e] = -1 - row
        self.table, self.mixed = self.table.to(DEVICE), self.mixed.to(DEVICE)
        self.x = torch.randn((t, H), generator=g).to(dtype).to(DEVICE)
        probs = torch.randn((t, E), generator=g).softmax(-1)
        weights, ids = probs.topk(k, dim=-1)
        self.ids, self.weights = ids.to(DEVICE), (weights / weights.sum(-1, keepdim=True)).to(dtype).to(DEVICE)

    def kernel(self, host: bool = False, **kw) -> torch.Tensor:
        return moe_kernels.moe(self.x, self.ids, self.weights, self.mixed if host else self.table, self.slab, I,
                               self.host if host else None, weight_format=self.fmt, **kw).cpu()

    def reference(self, host: bool = False) -> torch.Tensor:
        return reference.moe(self.x.float().cpu(), self.ids.cpu(), self.weights.float().cpu(),
                             (self.mixed if host else self.table).cpu(), self.slab.cpu(), I,
                             self.host.cpu() if host else None, weight_format=self.fmt)


FORMATS = ("q8_0", "q4_0", "q4_1", "fp8_b128", "q4_0+q8_0")


@pytest.mark.parametrize("t", [1, 5, 12])
@pytest.mark.parametrize("fmt", FORMATS)
def test_compact_extents_match_the_reference_in_slab_and_host_rows(fmt, t):
    """T = 1 (one tile per assignment, the ordered sum in the down launch), T = 5 and T = 12; the table
    pointing at slab rows, then two experts at host rows (negative entries). GGUF pieces take the few-rows
    path at T = 1 (one assignment a tile, no tensor cores); at T = 5 the slab rows do (10 assignments <= 3 x
    6 experts: unsorted, the atomic sum) and the host rows do not (a table with host rows allows E / 4):
    grouped, the tensor-core tiles, as at T = 12 for both."""
    experts = CompactExperts(fmt, t)
    assert rel_err(experts.kernel(), experts.reference()) < 1e-4
    assert rel_err(experts.kernel(host=True), experts.reference(host=True)) < 1e-4
    assert torch.equal(experts.reference(host=True), experts.reference())  # the host rows hold the same bytes


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "fp8_b128"])
def test_dequantized_in_registers_equals_the_dense_slab_bit_for_bit(fmt, monkeypatch):
    """A product-only dequantization gives the very fp32 weights the dense slab holds, so the same
    kernel, same tiles (the compact pieces' tensor-core `moe_config` for both: asked without the routing,
    it never picks the few-rows path), same order, gives the same bits."""
    experts = CompactExperts(fmt, t=3, seed=1)
    cfg = moe_kernels.moe_config(3, torch.float32, *expert_formats(fmt))
    assert not cfg.fma and cfg.block_m == 16
    monkeypatch.setattr(moe_kernels, "moe_config", lambda *args, **kwargs: cfg)
    plain = moe_kernels.moe(experts.x, experts.ids, experts.weights, experts.table, experts.dense_slab, I,
                            deterministic=True).cpu()
    assert torch.equal(experts.kernel(deterministic=True), plain)


@pytest.mark.parametrize("fmt", ["q4_1", "fp8_b128"])
def test_bf16_activations_within_1e_2_of_the_fp32_reference(fmt):
    experts = CompactExperts(fmt, t=4, dtype=torch.bfloat16, seed=2)
    got = experts.kernel(host=True)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, experts.reference(host=True)) < 1e-2


def test_route_moe_at_batch_1_routes_in_the_gate_up_launch_over_compact_extents():
    """The fused route path (T = 1): the ids and weights `router.route` gives, bit for bit, and `moe`'s
    output on them."""
    experts = CompactExperts("q4_0", t=1, seed=3)
    logits = torch.randn((1, E), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out, ids, weights = moe_kernels.route_moe(experts.x, logits, 2, True, experts.mixed, experts.slab, I,
                                              experts.host, weight_format="q4_0")
    want_ids, want_weights = router.route(logits, 2, True, torch.float32)  # the Triton route launch
    assert torch.equal(ids.cpu(), want_ids) and torch.equal(weights.cpu(), want_weights)
    want = moe_kernels.moe(experts.x, ids, weights, experts.mixed, experts.slab, I, experts.host,
                           weight_format="q4_0").cpu()
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("t", [1, 4])
def test_raw_addresses_of_compact_extents(t, monkeypatch):
    """`moe_ptr`: each table entry is an extent's first byte (here CPU memory under the interpreter). Raw
    addresses may name host memory, so at T = 4 `moe_ptr` keeps the tensor-core tiles where the slab's
    table takes the few-rows path (FMA_ROWS_PER_EXPERT_LINK): the same tiles given to both, the same bits."""
    experts = CompactExperts("q8_0", t=t, seed=5)
    addresses = experts.slab.data_ptr() + experts.table * experts.slab.stride(0)
    got = moe_kernels.moe_ptr(experts.x, experts.ids, experts.weights, addresses, I, deterministic=True,
                              weight_format="q8_0").cpu()
    if t > 1:
        cfg = moe_kernels.moe_config(t, torch.float32, "q8_0", "q8_0", top_k=2, num_experts=E, link=True)
        assert not cfg.fma and moe_kernels.moe_config(t, torch.float32, "q8_0", "q8_0", top_k=2, num_experts=E).fma
        monkeypatch.setattr(moe_kernels, "moe_config", lambda *args, **kwargs: cfg)
    assert torch.equal(got, experts.kernel(deterministic=True))


def test_formats_the_kernels_do_not_read_and_bad_slabs_are_refused():
    experts = CompactExperts("q8_0", t=2)
    args = (experts.x, experts.ids, experts.weights, experts.table)
    with pytest.raises(ValueError, match="the Triton MoE reads .* not q6_k"):
        moe_kernels.moe(*args, experts.slab, I, weight_format="q8_0+q6_k")
    with pytest.raises(ValueError, match=rf"must be uint8 \[R, >= {experts.extent_bytes}\]"):
        moe_kernels.moe(*args, experts.dense_slab, I, weight_format="q8_0")
    with pytest.raises(ValueError, match=rf"must be uint8 \[R, >= {experts.extent_bytes}\]"):
        moe_kernels.moe(*args, experts.slab[:, :experts.extent_bytes - 1], I, weight_format="q8_0")


def test_extent_layout_is_the_rad_extent():
    """Pieces at the offsets `reference._expert_pieces` reads them at; sizes as formats.nbytes."""
    layout = moe_kernels.extent_layout("q4_0+q8_0", I, H)
    assert (layout.up_offset, layout.down_offset) == (I * H // 32 * 18, 2 * I * H // 32 * 18)
    assert layout.size == 2 * I * H // 32 * 18 + H * I // 32 * 34
    assert (layout.gate_up, layout.down) == ("q4_0", "q8_0")
    plain = moe_kernels.extent_layout(None, I, H)
    assert (plain.gate_up, plain.up_offset, plain.down_offset, plain.size) == ("", I * H, 2 * I * H, 3 * I * H)


@pytest.mark.parametrize("t", [1, 3])
def test_the_moe_layer_passes_its_sources_format_to_the_ops_cuda_binds(t):
    """model/layers.py's MoE over a compact ResidentExperts: with the ops `select("cuda")` binds (the
    Triton router, linear and route_moe, here interpreted) as with the CPU's (the reference MoE)."""
    from types import SimpleNamespace

    from radianced.kernels import ops
    from radianced.model.experts import ResidentExperts
    from radianced.model.layers import MoE

    experts = CompactExperts("q4_1", t=t, seed=6)
    cfg = SimpleNamespace(moe_intermediate_size=I, num_experts=E, num_experts_per_tok=2, norm_topk_prob=True,
                          shared_expert_intermediate_size=0)
    router = torch.randn((E, H), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    source = ResidentExperts(experts.slab, {0: experts.table}, {0: "q4_1"})
    layer = MoE(cfg, 0, {"model.layers.0.mlp.gate.weight": router}.__getitem__, source)
    want = layer(experts.x).cpu()
    try:
        assert ops.select("cuda") == "triton" and ops.route_moe is moe_kernels.route_moe
        got = layer(experts.x).cpu()
    finally:
        ops.select("cpu")
    assert rel_err(got, want) < 1e-4


def test_gguf_experts_take_the_few_rows_path_while_a_step_routes_few_rows_an_expert():
    """Qwen3-Next's routing (512 experts, top-10): one assignment a tile, 16 columns x 256 values, up to 153
    tokens (3 assignments an expert on average) where every expert is in VRAM, up to 12 (E / 4) where the
    table may name host rows, and always at T = 1; else the tensor-core tiles. Not when a piece is not GGUF,
    nor without the routing."""
    bf16 = torch.bfloat16
    few = moe_kernels.MoEConfig(1, 16, 256, 16, 256, 4, 1, fma=True)
    routing = {"top_k": 10, "num_experts": 512}
    assert moe_kernels.moe_config(1, bf16, "q4_0", "q4_0", **routing) == few
    assert moe_kernels.moe_config(153, bf16, "q4_0", "q8_0", **routing) == few
    assert not moe_kernels.moe_config(154, bf16, "q4_0", "q8_0", **routing).fma
    assert moe_kernels.moe_config(12, bf16, "q4_1", "q4_1", **routing, link=True) == few
    assert not moe_kernels.moe_config(13, bf16, "q4_1", "q4_1", **routing, link=True).fma
    assert moe_kernels.moe_config(1, bf16, "q8_0", "q8_0", top_k=8, num_experts=8, link=True) == few
    assert not moe_kernels.moe_config(1, bf16, "q4_0", "fp8_b128", **routing).fma
    assert not moe_kernels.moe_config(1, bf16, **routing).fma
    assert not moe_kernels.moe_config(1, bf16, "q4_0", "q4_0").fma


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q4_1"])
def test_the_few_rows_path_over_several_k_steps(fmt, monkeypatch):
    """H = 544 (two 256-value steps and one of a single block), I = 96 (down's one step, 3 of 8 blocks):
    the path's K loop past its first step, its masked blocks, with the atomic sum (T = 3, unsorted) and the
    ordered one (deterministic), fp32 and bf16 activations (bf16: within its rounding of the fp32
    reference; the path multiplies the unrounded fp32 weights)."""
    monkeypatch.setattr(sys.modules[__name__], "H", 544)
    monkeypatch.setattr(sys.modules[__name__], "I", 96)
    experts = CompactExperts(fmt, t=3, seed=8)
    assert moe_kernels.moe_config(3, torch.float32, fmt, fmt, top_k=2, num_experts=E).fma
    want = experts.reference()
    assert rel_err(experts.kernel(), want) < 1e-4
    assert rel_err(experts.kernel(deterministic=True), want) < 1e-4
    bf16 = CompactExperts(fmt, t=3, dtype=torch.bfloat16, seed=8)
    assert rel_err(bf16.kernel(), bf16.reference()) < 1e-2


def test_decode_steps_of_a_gguf_piece_are_wider_and_its_columns_narrower():
    """`moe_config` at decode: a GGUF piece takes 32 columns x 256 values a step, other pieces 64 x 128
    (per piece: q4_0 gate/up beside an fp8_b128 down); prefill tiles are 64 x 64 whatever the format."""
    bf16 = torch.bfloat16
    assert moe_kernels.moe_config(1, bf16, "q4_0", "fp8_b128") == moe_kernels.MoEConfig(16, 32, 256, 64, 128, 4, 4)
    assert moe_kernels.moe_config(32, bf16, "fp8_b128", "q8_0") == moe_kernels.MoEConfig(32, 64, 128, 32, 256, 4, 4)
    assert moe_kernels.moe_config(32, torch.float32, "q4_1", "q4_1", top_k=8, num_experts=64).num_stages == 3
    assert moe_kernels.moe_config(1, bf16) == moe_kernels.MoEConfig(16, 64, 128, 64, 128, 4, 4)
    assert moe_kernels.moe_config(100, bf16, "q4_0", "q4_0") == moe_kernels.MoEConfig(64, 64, 64, 64, 64, 4, 3)
