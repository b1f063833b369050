"""kernels/gemm.py on the GPU: padded rows give F.linear's rows, and the warm-up meets every bucket
with the model's own weights (the first-call cost it removes is timed by tools/first_call_probe.py)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from radianced.kernels import gemm


def needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: the padding and the warm-up are CUDA-only")


@pytest.mark.parametrize("t", [1, 5, 17, 19, 100, 1000, 2049])
def test_the_first_rows_of_the_padded_product_are_f_linears(t):
    needs_cuda()
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(640, 2048, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    b = torch.randn(640, device="cuda", dtype=torch.bfloat16, generator=g)
    got, want = gemm.linear(x, w, b), F.linear(x.double(), w.double(), b.double())
    assert got.shape == (t, 640) and got.is_contiguous()
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-2  # bf16 operands, fp32 accumulation


def test_warm_up_calls_every_bucket_up_to_the_most_rows_met_and_forgets_dead_weights():
    needs_cuda()
    gemm._met.clear()
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    gone = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16)
    gemm.linear(torch.randn(300, 512, device="cuda", dtype=torch.bfloat16), w)
    gemm.linear(torch.randn(40, 512, device="cuda", dtype=torch.bfloat16), w)  # fewer rows: 300 stays the most
    gemm.linear(torch.randn(20, 512, device="cuda", dtype=torch.bfloat16), gone)
    del gone
    gc.collect()
    assert gemm.warm_up() == len(gemm.buckets(320)) == 35  # 300 rows ran as 320
    assert [key[:2] for key in gemm._met] == [(256, 512)]
