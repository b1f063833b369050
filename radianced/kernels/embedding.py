"""Token embeddings read from a table pinned in host RAM (`--embedding-placement ram`).

The table [V, H] stays in host memory registered with CUDA (mapped: its address
is valid on the device, as the expert host pool's rows are for kernels/moe.py).
`gather_rows` launches one program per (token, column block): it reads the token
id from the device, then that row's columns straight from host memory over the
link, and writes them to a device buffer [T, H]. Nothing runs on the host between
the ids and the rows, so the lookup is one launch inside a step and inside a
decode CUDA graph (a CPU-side index_select and copy would need the ids on the
host: a sync, and nothing a graph can capture).

Bytes over the link per step: T x H x itemsize (4 KiB a token for H = 2048 in
bf16), issued as the kernel's coalesced loads; ids out of [0, V) read nothing and
leave a zero row (the server refuses such ids before a step; the mask only keeps
a bad id from reading past the table).

`gather_rows` is `ops.gather_rows` on CUDA: what `Embedding` (model/layers.py)
calls when its table is not on the ids' device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 1024  # columns per program: 2 KiB of a bf16 row, 16 B a thread at 4 warps


@triton.jit
def _gather_rows_kernel(ids_ptr, table_ptr, out_ptr, vocab, hidden, stride_table, stride_out,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    token = tl.load(ids_ptr + row).to(tl.int64)
    ok = (token >= 0) & (token < vocab)
    in_row = cols < hidden
    vals = tl.load(table_ptr + token * stride_table + cols, mask=in_row & ok, other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, vals, mask=in_row)


def gather_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` ([T] int32/int64 on the compute device) of `table` ([V, H], contiguous rows; pinned host
    memory when the ids are on a GPU): [T, H] in the table's dtype on the ids' device."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be [T] int32 or int64, got shape {tuple(ids.shape)} dtype {ids.dtype}")
    if table.dim() != 2 or table.stride(1) != 1:
        raise ValueError(f"table must be [V, H] with contiguous rows, got shape {tuple(table.shape)} "
                         f"strides {table.stride()}")
    if ids.device.type == "cuda" and table.device.type == "cpu" and not table.is_pinned():
        raise ValueError("the embedding table is pageable CPU memory; a kernel reads host memory over the link "
                         "only when it is pinned (the loader registers it with CUDA)")
    t, (vocab, hidden) = ids.shape[0], table.shape
    out = torch.empty((t, hidden), dtype=table.dtype, device=ids.device)
    if t:
        block = min(BLOCK_H, triton.next_power_of_2(hidden))
        _gather_rows_kernel[(t, triton.cdiv(hidden, block))](
            ids, table, out, vocab, hidden, table.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out
