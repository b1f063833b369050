"""kernels/gemm.py: cuBLAS GEMMs at a bounded set of row counts (issue 18's first/twin TTFT gap)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radianced.kernels import gemm


def test_rows_are_padded_to_one_of_eight_steps_an_octave():
    assert [gemm.padded_rows(t) for t in (1, 7, 16, 17, 18, 19, 31, 32, 33, 63, 64, 65, 129, 4095, 4096)] == \
        [16, 16, 16, 18, 18, 20, 32, 32, 36, 64, 64, 72, 144, 4096, 4096]
    padded = [gemm.padded_rows(t) for t in range(1, 20000)]
    assert all(p >= t and p <= max(16, t * 1.125) for t, p in zip(range(1, 20000), padded))
    assert padded == sorted(padded)  # monotone: a longer step never pads to fewer rows
    assert all(gemm.padded_rows(p) == p for p in padded)  # a bucket is its own


def test_buckets_are_every_padded_count_up_to_the_limits():
    b = gemm.buckets(4096)
    assert b == sorted({gemm.padded_rows(t) for t in range(1, 4097)})
    assert len(b) == 65 and b[:9] == [16, 18, 20, 22, 24, 26, 28, 30, 32] and b[-2:] == [3840, 4096]
    assert gemm.buckets(17) == [16, 18] and gemm.buckets(1) == [16]


@pytest.mark.parametrize("t", [0, 1, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_on_the_cpu_it_is_f_linear_exactly(t, bias):
    g = torch.Generator().manual_seed(t)
    x, w = torch.randn(t, 24, generator=g), torch.randn(40, 24, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    assert torch.equal(gemm.linear(x, w, b), F.linear(x, w, b))


def test_the_cpu_meets_no_shape_to_warm():
    gemm.linear(torch.randn(50, 8), torch.randn(4, 8))
    assert all(key[-1].type == "cuda" for key in gemm._met)
