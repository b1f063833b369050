"""Hugging Face folder -> `.rad`.

The converter checks the whole folder first (config, tokenizer, every tensor's
name and shape against the config: `hf_source.read_folder`, `hf_plan.plan_hf`)
using only the safetensors headers, then streams: one tensor (or one expert's
three pieces) is read, optionally cast, written and dropped before the next.
Large tensors go through in row blocks of at most CHUNK_BYTES, so the
converter's own memory stays near one block whatever the model size.

Compact outputs (`model/quantize.py`): a block-scaled FP8 matrix (an F8_E4M3
`weight` with its `weight_scale_inv`) is kept as fp8_b128, its bytes as they
are, unless `--dtype` casts it (dequantized, then cast) or `--quantize` gives
its class another format; `--quantize` requantizes the classes it names. A
matrix that becomes compact is read whole (quantization needs all of it).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError
from tqdm import tqdm

from radianced.kernels.compact import CompactWeight, dense
from radianced.kernels.dequant import pack_fp8_b128
from radianced.model.convert import CASTS, ConvertError
from radianced.model.hf_plan import ExpertPieces, PlainTensor, plan_hf
from radianced.model.hf_source import ST_DTYPES, Shards, read_folder
from radianced.model.quantize import fits, plain_format, quantize
from radianced.model.rad_format import DTYPE_NAMES
from radianced.model.rad_writer import RadWriter

CHUNK_BYTES = 64 << 20  # largest row block read at once


def convert_hf(src: Path, dst: Path, dtype: str | None = None, formats: dict[str, str] | None = None) -> None:
    """Hugging Face folder -> `.rad`; validates everything before writing, then streams.

    `formats`: class -> compact format (`quantize.parse_quantize`), or None to requantize nothing.
    """
    formats = formats or {}
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
                    fmt = plain_format(item.name, item.shape, formats)
                    if fmt is not None or f"{item.name}_scale_inv" in shards.tensors:
                        _add_matrix(w, item.name, _matrix(shards, item.name, fmt, cast))
                    else:
                        out_dtype = cast or ST_DTYPES[shards.tensors[item.name].dtype]
                        w.add_tensor_chunks(item.name, out_dtype, item.shape, _row_blocks(shards, item, cast))
                else:
                    w.add_expert(item.layer, item.expert, *_expert_pieces(shards, item, cast, formats))
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


def _add_matrix(w: RadWriter, name: str, t: torch.Tensor | CompactWeight) -> None:
    if isinstance(t, CompactWeight):
        w.add_compact(name, t)
    else:
        w.add_tensor(name, t)


def _matrix(shards: Shards, name: str, fmt: str | None, cast: torch.dtype | None) -> torch.Tensor | CompactWeight:
    """Matrix `name` whole: requantized to `fmt` if given, else as stored (FP8 with its scales kept
    compact), cast if asked (a compact one dequantized first)."""
    t: torch.Tensor | CompactWeight = shards.read(name)
    if f"{name}_scale_inv" in shards.tensors:
        t = CompactWeight("fp8_b128", tuple(t.shape), pack_fp8_b128(t, shards.read(f"{name}_scale_inv")))
    if fmt is not None:
        return t if isinstance(t, CompactWeight) and t.fmt == fmt else quantize(dense(t, torch.float32), fmt)
    if cast is None:
        return t
    return t.dequantize(cast) if isinstance(t, CompactWeight) else t.to(cast)


def _expert_pieces(shards: Shards, item: ExpertPieces, cast: torch.dtype | None, formats: dict[str, str]):
    """gate [I, H], up [I, H], down [H, I] of one expert; for a fused layout only its slice is read.
    Requantized when `formats` names the experts' class and both shapes fit the format."""
    x, e = item.prefix, item.expert
    if not item.fused:
        fmt = formats.get("experts")
        h = shards.tensors[f"{x}{e}.down_proj.weight"].shape[0]
        if fmt is not None and not (fits(fmt, (item.inter, h)) and fits(fmt, (h, item.inter))):
            fmt = None
        return tuple(_matrix(shards, f"{x}{e}.{w}_proj.weight", fmt, cast) for w in ("gate", "up", "down"))
    gate_up = shards.read(f"{x}gate_up_proj", e)  # [2I, H], gate first
    gate, up = gate_up[:item.inter], gate_up[item.inter:]
    down = shards.read(f"{x}down_proj", e)  # [H, I]
    if cast is not None:
        gate, up, down = gate.to(cast), up.to(cast), down.to(cast)
    fmt = formats.get("experts")
    if fmt is not None and fits(fmt, tuple(gate.shape)) and fits(fmt, tuple(down.shape)):
        return quantize(gate, fmt), quantize(up, fmt), quantize(down, fmt)
    return gate, up, down
