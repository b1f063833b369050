"""Hugging Face folder -> `.rad`.

The converter checks the whole folder first (config, tokenizer, every tensor's
name and shape against the config: `hf_source.read_folder`, `hf_plan.plan_hf`)
using only the safetensors headers, then streams: one tensor (or one expert's
three pieces) is read, optionally cast, written and dropped before the next.
Large tensors go through in row blocks of at most CHUNK_BYTES, so the
converter's own memory stays near one block whatever the model size.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError
from tqdm import tqdm

from radianced.model.convert import CASTS, ConvertError
from radianced.model.hf_plan import ExpertPieces, PlainTensor, plan_hf
from radianced.model.hf_source import ST_DTYPES, Shards, read_folder
from radianced.model.rad_format import DTYPE_NAMES
from radianced.model.rad_writer import RadWriter

CHUNK_BYTES = 64 << 20  # largest row block read at once


def convert_hf(src: Path, dst: Path, dtype: str | None = None) -> None:
    """Hugging Face folder -> `.rad`; validates everything before writing, then streams."""
    folder = read_folder(src)
    shards = Shards(src)
    model, plan = plan_hf(folder.model, shards)
    cast = CASTS[dtype] if dtype else None
    _check_dtypes(shards, plan, cast)
    try:
        with RadWriter(dst, model=model, tokenizer_json=folder.tokenizer_json, chat_template=folder.chat_template,
                       generation=folder.generation, source=f"hf:{src.resolve()}") as w, \
                tqdm(total=len(plan), desc=f"converting {src.name}", unit="tensor",
                     disable=not sys.stderr.isatty(), file=sys.stderr) as bar:
            for item in plan:
                if isinstance(item, PlainTensor):
                    out_dtype = cast or ST_DTYPES[shards.tensors[item.name].dtype]
                    w.add_tensor_chunks(item.name, out_dtype, item.shape, _row_blocks(shards, item, cast))
                else:
                    w.add_expert(item.layer, item.expert, *_expert_pieces(shards, item, cast))
                shards.release_if_due()
                bar.update()
    except SafetensorError as e:
        raise ConvertError(f"{src}: reading the weights failed ({e}); download the checkpoint again") from None
    finally:
        shards.close()


def _check_dtypes(shards: Shards, plan: list, cast: torch.dtype | None) -> None:
    for item in plan:
        if isinstance(item, PlainTensor):
            names = [item.name]
        elif item.fused:
            names = [f"{item.prefix}gate_up_proj", f"{item.prefix}down_proj"]
        else:
            names = [f"{item.prefix}{item.expert}.{w}_proj.weight" for w in ("gate", "up", "down")]
        for name in names:
            st = shards.tensors[name].dtype
            torch_dtype = ST_DTYPES.get(st)
            if torch_dtype is None:
                raise ConvertError(f"{shards.where(name)}: tensor {name} has dtype {st}; radianced converts "
                                   f"floating-point weights only")
            if cast is None and torch_dtype not in DTYPE_NAMES:
                raise ConvertError(f"{shards.where(name)}: tensor {name} is {st}, which a .rad cannot hold; "
                                   f"pass --dtype bf16 or --dtype fp32 to cast")
        if not isinstance(item, PlainTensor) and cast is None:
            if len({shards.tensors[n].dtype for n in names}) > 1:
                raise ConvertError(f"{shards.where(names[0])}: the pieces of expert {item.prefix}{item.expert} "
                                   f"differ in dtype; pass --dtype bf16 or --dtype fp32 to cast")


def _row_blocks(shards: Shards, item: PlainTensor, cast: torch.dtype | None) -> Iterator[torch.Tensor]:
    """The tensor in row blocks of at most CHUNK_BYTES (whole when small), cast block by block."""
    itemsize = ST_DTYPES[shards.tensors[item.name].dtype].itemsize
    nbytes = math.prod(item.shape) * itemsize
    if len(item.shape) < 2 or nbytes <= CHUNK_BYTES:
        blocks = [None]
    else:
        rows = max(1, CHUNK_BYTES // (math.prod(item.shape[1:]) * itemsize))
        blocks = [slice(r, min(r + rows, item.shape[0])) for r in range(0, item.shape[0], rows)]
    for index in blocks:
        block = shards.read(item.name, index)
        yield block if cast is None else block.to(cast)
        del block
        shards.release_if_due()  # within a large tensor too: its pages leave as the blocks are written


def _expert_pieces(shards: Shards, item: ExpertPieces, cast: torch.dtype | None):
    """gate [I, H], up [I, H], down [H, I] of one expert; for a fused layout only its slice is read."""
    x, e = item.prefix, item.expert
    if item.fused:
        gate_up = shards.read(f"{x}gate_up_proj", e)  # [2I, H], gate first
        gate, up = gate_up[:item.inter], gate_up[item.inter:]
        down = shards.read(f"{x}down_proj", e)  # [H, I]
    else:
        gate, up, down = (shards.read(f"{x}{e}.{w}_proj.weight") for w in ("gate", "up", "down"))
    if cast is not None:
        gate, up, down = gate.to(cast), up.to(cast), down.to(cast)
    return gate, up, down
