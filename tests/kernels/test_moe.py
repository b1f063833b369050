"""The Triton pointer-table MoE against `reference.moe`, and its on-device grouping.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1,
set by tests/kernels/interpreter.py before triton is imported), so shapes stay small and odd: H = 72,
I = 40 (neither a multiple of the column blocks), E = 10 experts in a slab with
spare rows, the table a permutation. fp32 within 1e-4 of max|ref| (IEEE
products), bf16 within 1e-2 of the fp32 reference on the same bf16 values.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import DEVICE, require_interpreted  # before triton loads
from tests.kernels.compare import rel_err

from radianced.kernels import moe as moe_kernels
from radianced.kernels import reference

require_interpreted(moe_kernels._moe_gate_up_kernel, "moe")

E, H, I = 10, 72, 40
SPARE = 3  # slab rows no expert uses


class Experts:
    """x, routing and a slab whose table is a permutation with spare rows, as the slot manager leaves it."""

    def __init__(self, t: int, k: int, dtype: torch.dtype = torch.float32, seed: int = 0,
                 ids: torch.Tensor | None = None):
        g = torch.Generator().manual_seed(seed)
        self.slab = (torch.randn((E + SPARE, 3 * I * H), generator=g) * H ** -0.5).to(dtype).to(DEVICE)
        self.table = torch.randperm(E + SPARE, generator=g)[:E].to(DEVICE)
        self.x = torch.randn((t, H), generator=g).to(dtype).to(DEVICE)
        probs = torch.randn((t, E), generator=g).softmax(-1)
        weights, top = probs.topk(k, dim=-1)
        self.ids = (top if ids is None else ids).to(DEVICE)
        self.weights = (weights / weights.sum(-1, keepdim=True)).to(dtype).to(DEVICE)

    def reference(self) -> torch.Tensor:
        return reference.moe(self.x.float().cpu(), self.ids.cpu(), self.weights.float().cpu(), self.table.cpu(),
                             self.slab.float().cpu(), I)

    def kernel(self, **kw) -> torch.Tensor:
        return moe_kernels.moe(self.x, self.ids, self.weights, self.table, self.slab, I, **kw).cpu()


@pytest.mark.parametrize("t", [1, 15, 63, 300])
def test_matches_reference_at_odd_token_counts(t):
    """T = 1 (decode: one tile per expert), 15, 63 (one tile per expert), 300 (several tiles per expert)."""
    experts = Experts(t, k=4 if t < 300 else 2)
    assert rel_err(experts.kernel(), experts.reference()) < 1e-4


@pytest.mark.parametrize("t", [1, 33])
def test_bf16_within_1e_2_of_fp32(t):
    experts = Experts(t, k=3, dtype=torch.bfloat16, seed=1)
    assert rel_err(experts.kernel(), experts.reference()) < 1e-2
    assert experts.kernel().dtype == torch.bfloat16


def test_one_expert_serving_every_token_spans_several_tiles():
    """Skewed routing: expert 7 in every token's top-2 (100 rows: two 64-row tiles), expert 2 in half."""
    t = 100
    ids = torch.stack([torch.full((t,), 7), torch.where(torch.arange(t) % 2 == 0, 2, 4)], dim=1)
    experts = Experts(t, k=2, seed=2, ids=ids)
    assert rel_err(experts.kernel(), experts.reference()) < 1e-4


def test_deterministic_sum_matches_and_repeats_bitwise():
    experts = Experts(20, k=3, seed=3)
    first = experts.kernel(deterministic=True)
    assert rel_err(first, experts.reference()) < 1e-4
    assert torch.equal(first, experts.kernel(deterministic=True))
    assert rel_err(first, experts.kernel()) < 1e-5


@pytest.mark.parametrize("deterministic", [True, False], ids=["ordered_sum", "atomic_scatter"])
@pytest.mark.parametrize("t", [1, 15])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_residual_is_added_in_the_last_launch(t, dtype, deterministic):
    """`residual=` gives `residual + moe(x)`, each rounded to x's dtype as torch rounds the unfused
    sum: the kernel's own result plus the residual, bitwise (the fused add changes nothing else)."""
    experts = Experts(t, k=3, dtype=dtype, seed=10)
    residual = torch.randn((t, H), generator=torch.Generator().manual_seed(11)).to(dtype).to(DEVICE)
    got = experts.kernel(deterministic=deterministic, residual=residual)
    alone = experts.kernel(deterministic=True)
    if deterministic:
        assert torch.equal(got, residual.cpu() + alone)
    else:  # the atomic scatter may sum in another order: within rounding of the ordered one
        assert rel_err(got.float(), (residual.cpu() + alone).float()) < (1e-5 if dtype == torch.float32 else 1e-2)
    want = reference.moe(experts.x.float().cpu(), experts.ids.cpu(), experts.weights.float().cpu(),
                         experts.table.cpu(), experts.slab.float().cpu(), I, residual=residual.float().cpu())
    assert rel_err(got.float(), want) < (1e-4 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_batch_1_sums_in_its_down_launch_as_the_grouped_path_does(dtype):
    """At T = 1 the last of a column block's k down programs sums the k rows (the residual added):
    bit for bit the grouped path's separate ordered sum for the same token (row 0 of a T = 2 batch
    whose row 1 is another token), and again on a second call (the arrival counters reset)."""
    pair = Experts(2, k=4, dtype=dtype, seed=12)
    residual = torch.randn((2, H), generator=torch.Generator().manual_seed(13)).to(dtype).to(DEVICE)
    grouped = pair.kernel(deterministic=True, residual=residual)
    one = moe_kernels.moe(pair.x[:1], pair.ids[:1], pair.weights[:1], pair.table, pair.slab, I,
                          residual=residual[:1]).cpu()
    assert torch.equal(one, grouped[:1])
    again = moe_kernels.moe(pair.x[:1], pair.ids[:1], pair.weights[:1], pair.table, pair.slab, I,
                            residual=residual[:1]).cpu()
    assert torch.equal(again, one)


def test_residual_of_another_shape_is_refused():
    experts = Experts(3, k=2)
    with pytest.raises(ValueError, match="residual must be like x"):
        experts.kernel(residual=torch.zeros((2, H), device=DEVICE))


def test_weights_are_read_through_the_table():
    """Moving an expert to a spare slab row and repointing its table entry changes nothing."""
    experts = Experts(9, k=2, seed=4)
    before = experts.kernel(deterministic=True)  # bitwise comparisons need the fixed-order sum on a GPU
    e = int(experts.ids[0, 0])
    spare = next(r for r in range(E + SPARE) if r not in experts.table.tolist())
    experts.slab[spare] = experts.slab[experts.table[e]]
    experts.slab[experts.table[e]] = float("nan")  # the old row must not be read
    experts.table[e] = spare
    assert torch.equal(experts.kernel(deterministic=True), before)


@pytest.mark.parametrize("t", [1, 15])
def test_negative_entries_read_the_host_pool(t):
    """tiers/slab.py's table: entry >= 0 a slab row (VRAM slot), entry < 0 host row -1 - entry."""
    experts = Experts(t, k=3, seed=8)
    g = torch.Generator().manual_seed(9)
    host = (torch.randn((6, 3 * I * H), generator=g) * H ** -0.5).to(DEVICE)
    if DEVICE == "cuda":
        host = host.cpu().pin_memory()  # the kernels read it over the link
    table = experts.table.clone()
    table[torch.tensor([0, 3, 4, 9])] = torch.tensor([-1, -6, -3, -2], device=DEVICE)
    got = moe_kernels.moe(experts.x, experts.ids, experts.weights, table, experts.slab, I, host).cpu()
    want = reference.moe(experts.x.cpu(), experts.ids.cpu(), experts.weights.cpu(), table.cpu(),
                         experts.slab.cpu(), I, host.cpu())
    assert rel_err(got, want) < 1e-4


def test_raw_address_table_gives_the_same_result():
    """`moe_ptr`: the table holds each expert's address (here CPU memory under the interpreter)."""
    experts = Experts(12, k=3, seed=5)
    row_bytes = experts.slab.stride(0) * experts.slab.element_size()
    addresses = experts.slab.data_ptr() + experts.table * row_bytes
    got = moe_kernels.moe_ptr(experts.x, experts.ids, experts.weights, addresses, I, deterministic=True).cpu()
    assert torch.equal(got, experts.kernel(deterministic=True))


@pytest.mark.parametrize("fused_max", [1024, 0], ids=["counting_sort", "torch_sort"])
def test_grouping_by_expert_on_the_device(fused_max):
    """Sorted assignment order and the tile map, exactly: tiles of 2 rows, experts 0, 1, 3 routed."""
    ids = torch.tensor([[3, 1], [3, 0], [1, 3]], device=DEVICE)
    order, tile_info = moe_kernels.group_by_expert(ids, num_experts=5, block_m=2, fused_max=fused_max)
    # assignments t * k + j sorted by expert, stable: 0 <- 3; 1 <- 1, 4; 3 <- 0, 2, 5
    assert order.tolist() == [3, 1, 4, 0, 2, 5]
    assert tile_info.shape == (6 // 2 + 5, 3)  # the host's bound: A // BLOCK_M + min(E, A)
    assert tile_info.tolist() == [[0, 0, 1], [1, 1, 3], [3, 3, 5], [3, 5, 6]] + [[-1, 0, 0]] * 4


def test_counting_sort_and_torch_sort_group_alike():
    """The one-program counting sort (decode batches) equals torch.sort + align on 300 x 8 skewed ids."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn((300, 37), generator=g)
    logits[:, 5] += 3  # a hot expert spanning several tiles
    ids = logits.topk(8, dim=-1).indices.to(DEVICE)
    counted = moe_kernels.group_by_expert(ids, num_experts=37, block_m=64, fused_max=10 ** 6)
    sorted_ = moe_kernels.group_by_expert(ids, num_experts=37, block_m=64, fused_max=0)
    assert torch.equal(counted[0], sorted_[0]) and torch.equal(counted[1], sorted_[1])


def test_slab_of_the_wrong_width_is_refused_with_the_numbers():
    experts = Experts(2, k=2)
    with pytest.raises(ValueError, match=rf"slab must be \[R, 3 \* I \* H\] = \[R, {3 * 41 * H}\]"):
        moe_kernels.moe(experts.x, experts.ids, experts.weights, experts.table, experts.slab, 41)
