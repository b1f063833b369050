"""The host-table gather (`--embedding-placement ram`) against torch's embedding: bit for bit.

Without CUDA the kernel runs in Triton's interpreter with the table and ids on the CPU;
on a GPU the table is pinned host memory and the ids and rows are on the card, as in
the daemon. Hidden sizes below, at and past the column block, repeated ids, one token,
many tokens, both id dtypes, a table whose rows are wider than H (a column slice).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.interpreter import DEVICE, require_interpreted  # before triton loads

from radianced.kernels import embedding, reference

require_interpreted(embedding._gather_rows_kernel, "embedding")

VOCAB = 50


def host_table(vocab: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A seeded [vocab, hidden] table in host memory, pinned where a GPU reads it."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn((vocab, hidden), generator=g).to(dtype)
    return table.pin_memory() if DEVICE == "cuda" else table


def ids_on_device(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("hidden", [1, 7, 130, embedding.BLOCK_H, embedding.BLOCK_H + 3, 2 * embedding.BLOCK_H + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_matches_torch_embedding(hidden, dtype):
    table = host_table(VOCAB, hidden, dtype, seed=hidden)
    ids = ids_on_device([3, 0, VOCAB - 1, 3, 17, 3])  # repeated ids, the first and last rows
    got = embedding.gather_rows(table, ids)
    assert got.device == ids.device and got.dtype == dtype and got.shape == (6, hidden)
    assert torch.equal(got.cpu(), F.embedding(ids.cpu(), table))
    assert torch.equal(got, reference.gather_rows(table, ids))


def test_one_token():
    table = host_table(VOCAB, 96, torch.bfloat16)
    got = embedding.gather_rows(table, ids_on_device([41], torch.int32))
    assert torch.equal(got.cpu(), table[41:42])


def test_many_tokens():
    table = host_table(VOCAB, 64, torch.float32, seed=2)
    ids = torch.randint(0, VOCAB, (700,), generator=torch.Generator().manual_seed(5))
    got = embedding.gather_rows(table, ids.to(DEVICE))
    assert torch.equal(got.cpu(), F.embedding(ids, table))


def test_no_tokens():
    got = embedding.gather_rows(host_table(VOCAB, 32, torch.float32), ids_on_device([]))
    assert got.shape == (0, 32) and got.device == torch.device(DEVICE)


def test_rows_wider_than_hidden():
    wide = host_table(VOCAB, 80, torch.float32, seed=3)
    table = wide[:, 8:40]  # stride(0) 80: the kernel steps by the row stride, not by H
    ids = ids_on_device([9, 2, 9])
    assert torch.equal(embedding.gather_rows(table, ids).cpu(), table[[9, 2, 9]])


def test_ids_outside_the_vocabulary_read_nothing():
    table = host_table(VOCAB, 16, torch.float32, seed=4)
    got = embedding.gather_rows(table, ids_on_device([VOCAB, 5, -1])).cpu()
    assert torch.equal(got[1], table[5])
    assert torch.equal(got[[0, 2]], torch.zeros(2, 16))


def test_the_reference_matches_torch():
    table = host_table(VOCAB, 24, torch.bfloat16, seed=6)
    ids = ids_on_device([1, 1, 30])
    got = reference.gather_rows(table, ids)
    assert got.device == ids.device and torch.equal(got.cpu(), table[[1, 1, 30]])


@pytest.mark.parametrize("ids,table,message", [
    (torch.zeros((2, 2), dtype=torch.int64), torch.zeros(4, 8), "ids must be"),
    (torch.zeros(2, dtype=torch.float32), torch.zeros(4, 8), "ids must be"),
    (torch.zeros(2, dtype=torch.int64), torch.zeros(8, 4).t(), "contiguous rows"),
])
def test_bad_arguments_are_named(ids, table, message):
    with pytest.raises(ValueError, match=message):
        embedding.gather_rows(table, ids.to(DEVICE))
