"""kernels/stage.py: a step's routed host experts copied to the staging rows, and the MoE over them.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (the "host" rows are then
plain CPU memory, addressed as the card addresses pinned memory)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import DEVICE, require_interpreted  # before triton loads

from radianced.kernels import moe as moe_kernels
from radianced.kernels import stage
from tests.kernels.test_moe_compact import HOST_EXPERTS, CompactExperts, I

require_interpreted(stage._plan_kernel, "stage")

WIDTH = 96  # bytes a row: 6 16-byte words


def _rows(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, WIDTH), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def _address(t: torch.Tensor, row: int) -> int:
    return t.data_ptr() + row * t.stride(0)


def test_the_routed_host_experts_are_copied_in_id_order_up_to_the_staging_rows():
    """Experts 0-5: 0 and 3 in slots, 1, 2, 4, 5 in host rows; the routing takes 5, 1, 3 and 4 (5 and 1
    twice), not 2. Two staging rows: the misses in id order are 1, 4, 5, so 1 and 4 are staged, 5 is
    left at its host row, and 2, not routed, keeps its host row too."""
    slab, host = _rows(4, 0).to(DEVICE), _rows(4, 1).to(DEVICE)
    staging = torch.zeros((2, WIDTH), dtype=torch.uint8, device=DEVICE)
    table = torch.tensor([2, -1 - 3, -1 - 0, 1, -1 - 2, -1 - 1], device=DEVICE)
    ids = torch.tensor([[5, 1], [3, 5], [1, 4]], device=DEVICE)
    got = stage.stage_misses(ids, table, slab, host, staging).tolist()
    assert got == [_address(slab, 2), _address(staging, 0), _address(host, 0), _address(slab, 1),
                   _address(staging, 1), _address(host, 1)]
    assert torch.equal(staging[0], host[3]) and torch.equal(staging[1], host[2])


def test_the_ranks_carry_across_the_plans_chunks_of_experts():
    """200 experts (the plan ranks 64 at a time at 128 assignments), about half in host rows, 16 tokens x top-8, 30
    staging rows: the first 30 routed host experts in id order are staged wherever their chunk, the rest stay at
    their host rows, and entries past the host's rows are left alone."""
    g = torch.Generator().manual_seed(3)
    e, rows = 200, 30
    slab, host = _rows(e, 11).to(DEVICE), _rows(120, 12).to(DEVICE)
    staging = torch.zeros((rows, WIDTH), dtype=torch.uint8, device=DEVICE)
    in_host = torch.rand(e, generator=g) < 0.5
    table = torch.where(in_host, -1 - torch.randint(0, 130, (e,), generator=g), torch.arange(e))  # rows >= 120: past
    ids = torch.stack([torch.randperm(e, generator=g)[:8] for _ in range(16)])
    got = stage.stage_misses(ids.to(DEVICE), table.to(DEVICE), slab, host, staging).tolist()
    routed = set(ids.flatten().tolist())
    misses = [x for x in range(e) if x in routed and -1 - int(table[x]) in range(120) and table[x] < 0]
    assert len(misses) > rows and max(misses[:rows]) >= 64  # staged experts in more than one chunk
    for x in range(e):
        if x in misses[:rows]:
            j = misses.index(x)
            assert got[x] == _address(staging, j) and torch.equal(staging[j], host[-1 - int(table[x])])
        elif table[x] >= 0:
            assert got[x] == _address(slab, int(table[x]))
        else:  # in place: a host row (or, past the host's rows, the address the in-place path would compute)
            assert got[x] == host.data_ptr() + (-1 - int(table[x])) * host.stride(0)


def test_a_step_with_no_misses_copies_nothing():
    slab, host = _rows(4, 2).to(DEVICE), _rows(2, 3).to(DEVICE)
    staging = torch.zeros((3, WIDTH), dtype=torch.uint8, device=DEVICE)
    table = torch.tensor([0, 1, -1, 2], device=DEVICE)
    got = stage.stage_misses(torch.tensor([[0, 1], [3, 1]], device=DEVICE), table, slab, host, staging)
    assert got.tolist() == [_address(slab, 0), _address(slab, 1), _address(host, 0), _address(slab, 2)]
    assert not staging.any()


@pytest.mark.parametrize("rows", [1, 2], ids=["one_staged_one_in_place", "both_staged"])
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q4_1"])
def test_the_moe_over_staged_misses_equals_the_moe_reading_them_in_place(fmt, t, rows):
    """Bit for bit: the same bytes through the same kernels (T = 1 the few-rows path, T = 5 the tiles
    over a table with host rows), with one or both host experts (HOST_EXPERTS) staged."""
    experts = CompactExperts(fmt, t, seed=7)
    width = experts.host.shape[1]
    staging = torch.zeros((rows, width), dtype=torch.uint8, device=DEVICE)
    assert stage.wanted(experts.ids.numel(), experts.host, staging, fmt)
    staged = experts.kernel(host=True, deterministic=True, staging=staging)
    assert torch.equal(staged, experts.kernel(host=True, deterministic=True))
    routed = sorted(e for e in HOST_EXPERTS if (experts.ids == e).any())
    for j, e in enumerate(routed[:rows]):
        assert torch.equal(staging[j], experts.host[HOST_EXPERTS[e]])


def test_route_moe_at_batch_1_routes_first_when_it_stages():
    """The fused route path gives way: ids and output as the unstaged call gives them."""
    experts = CompactExperts("q4_0", t=1, seed=3)
    logits = torch.randn((1, 6), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    logits[0, list(HOST_EXPERTS)] += 10  # both host experts routed
    staging = torch.zeros((2, experts.host.shape[1]), dtype=torch.uint8, device=DEVICE)
    args = (experts.x, logits, 2, True, experts.mixed, experts.slab, I, experts.host)
    out, ids, weights = moe_kernels.route_moe(*args, weight_format="q4_0", staging=staging)
    want, want_ids, want_weights = moe_kernels.route_moe(*args, weight_format="q4_0")
    assert sorted(ids.flatten().tolist()) == sorted(HOST_EXPERTS)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights) and torch.equal(out, want)
    assert torch.equal(staging[0], experts.host[HOST_EXPERTS[1]])


def test_what_is_staged():
    host = torch.zeros((1, 16), dtype=torch.uint8)
    staging = torch.zeros((1, 16), dtype=torch.uint8)
    assert stage.wanted(8, host, staging, "q4_0") and stage.wanted(8, host, staging, "q4_0+q8_0")
    assert not stage.wanted(8, host, staging, "fp8_b128")  # its tiles read 16-byte runs in place
    assert not stage.wanted(8, host, staging, "q4_0+fp8_b128")
    assert not stage.wanted(8, host, staging, None)  # bf16 experts
    assert not stage.wanted(8, None, staging, "q4_0") and not stage.wanted(8, host, None, "q4_0")
    assert not stage.wanted(stage.MAX_ASSIGNMENTS + 1, host, staging, "q4_0")  # a prefill chunk


def test_staging_rows_must_be_whole_16_byte_words_of_a_host_row():
    slab, host = _rows(2, 4).to(DEVICE), _rows(2, 5).to(DEVICE)
    table = torch.tensor([0, -1], device=DEVICE)
    ids = torch.tensor([[1]], device=DEVICE)
    with pytest.raises(ValueError, match="a multiple of 16 bytes"):
        stage.stage_misses(ids, table, slab, host, torch.zeros((1, 40), dtype=torch.uint8, device=DEVICE))
    with pytest.raises(ValueError, match="at most its row stride"):  # would read past a host row
        stage.stage_misses(ids, table, slab, host, torch.zeros((1, WIDTH + 16), dtype=torch.uint8, device=DEVICE))
    with pytest.raises(ValueError, match="16-byte aligned"):  # a view one byte into its rows
        stage.stage_misses(ids, table, slab, _rows(3, 6).to(DEVICE).view(-1)[1:1 + 2 * WIDTH].view(2, WIDTH),
                           torch.zeros((1, WIDTH), dtype=torch.uint8, device=DEVICE))
    with pytest.raises(ValueError, match="must be uint8"):
        stage.stage_misses(ids, table, slab, host, torch.zeros((1, 24), dtype=torch.float32, device=DEVICE))
