"""The Triton greedy pick against `reference.argmax` (torch's): bit for bit, ties to the lowest index.

Without CUDA the kernel runs in Triton's interpreter on CPU tensors: widths below,
at and past a multiple of the block (the parts' reduction), rows of ties, -inf rows.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import DEVICE, rand, require_interpreted  # before triton loads

from radianced.kernels import argmax, reference

require_interpreted(argmax._argmax_kernel, "argmax")


@pytest.mark.parametrize("width", [1, 7, argmax.BLOCK, 3 * argmax.BLOCK + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_torch(width, dtype):
    logits = rand(3, width, dtype=dtype, seed=width)
    assert torch.equal(argmax.argmax(logits).cpu(), reference.argmax(logits.cpu()))


def test_ties_keep_the_lowest_index_across_parts():
    width = 3 * argmax.BLOCK + 5
    logits = torch.zeros(4, width, device=DEVICE)
    logits[0, [5, argmax.BLOCK + 1, width - 1]] = 2.0  # first max in part 0
    logits[1, [argmax.BLOCK + 7, 2 * argmax.BLOCK]] = 2.0  # first max in part 1
    logits[2, :] = float("-inf")  # all -inf: index 0, as torch
    logits[3, [width - 2, width - 1]] = 1.0  # the last part
    got = argmax.argmax(logits).cpu()
    assert got.tolist() == [5, argmax.BLOCK + 7, 0, width - 2]
    assert torch.equal(got, reference.argmax(logits.cpu()))


def test_rows_of_a_wider_tensor():
    wide = rand(2, 300, seed=3)
    assert torch.equal(argmax.argmax(wide[:, :200]).cpu(), reference.argmax(wide[:, :200].cpu()))


def test_bad_logits_are_refused():
    with pytest.raises(ValueError, match=r"logits must be \[B, V\] with V >= 1"):
        argmax.argmax(rand(4))
    with pytest.raises(ValueError, match=r"unit last stride"):
        argmax.argmax(rand(5, 4).t())
    with pytest.raises(ValueError, match=r"dtype torch.int64 is not supported"):
        argmax.argmax(torch.zeros(2, 3, dtype=torch.int64, device=DEVICE))
