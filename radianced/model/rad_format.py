"""The `.rad` model container's on-disk layout: the preamble, the header and its entries.

Layout (all integers little-endian):

    [0, 4096)      preamble: b"RADIANCE" | u32 version | u64 header offset |
                   u64 header length | u64 xxh3_64(header) | zeros
    [4096, ...)    tensor data; every tensor and every expert extent starts at a
                   multiple of ALIGN (4096), so each can be read with O_DIRECT
    header         msgpack `Header` at the end, after the last extent (its offset
                   is aligned too); the writer patches the preamble when it closes

The header sits at the end so a converter can stream tensor by tensor without
knowing the index in advance. A routed expert (layer, expert) is ONE extent:
gate [I, H] | up [I, H] | down [H, I], same format, no padding between the
pieces, so a single read fetches it. Each tensor and extent carries the xxh3_64
of its bytes.

Every tensor and extent records its format in `dtype`: a plain torch dtype
(f32 / f16 / bf16 / f8_e4m3, as files before compact weights had) or a compact
format (q8_0 / q4_0 / q4_1 / q4_k / q5_k / q6_k / fp8_b128, layouts in
`kernels/formats.py`). A compact expert piece holds its own scales, so the
extent stays one read with everything needed to use it; its bytes are
`formats.FORMATS[dtype].nbytes(shape)` per piece. An expert whose down piece has
another format than gate and up (a GGUF Q4_K_M: Q4_K gate/up, Q6_K down) records
"gate_up+down", e.g. "q4_k+q6_k". Files written before compact
formats hold only plain dtypes and read as they always did.

`rad_writer.RadWriter` writes this layout, `rad.RadFile` reads it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

import msgspec
import torch

from radianced.kernels.formats import FORMATS, expert_formats
from radianced.model.config import ModelConfig

RAD_VERSION = 1
ALIGN = 4096
MAGIC = b"RADIANCE"
_PREAMBLE = struct.Struct("<8sIQQQ")  # magic, version, header offset, header length, header xxh3_64

DTYPES: dict[str, torch.dtype] = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "f8_e4m3": torch.float8_e4m3fn,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


class RadError(Exception):
    """A `.rad` cannot be written or read; the message names the file and tensor and what to do."""


@dataclass(frozen=True, slots=True)
class Preamble:
    """The start of a `.rad` (the rest of its first ALIGN bytes are zeros).

    version: the format version the file was written in (RAD_VERSION by this radianced).
    header_offset: where the msgpack `Header` starts, a multiple of ALIGN; 0 in a file
        whose writer never finished (an interrupted conversion).
    header_length: the header's length in bytes; 0 likewise.
    header_checksum: xxh3_64 of the header's bytes. The header records every tensor's
        offset and checksum, so this names the file's contents: a re-conversion of the
        same model gets another one (the expert profile is keyed by it).
    """

    version: int
    header_offset: int
    header_length: int
    header_checksum: int

    SIZE: ClassVar[int] = _PREAMBLE.size  # the bytes `unpack` needs

    def pack(self) -> bytes:
        return _PREAMBLE.pack(MAGIC, self.version, self.header_offset, self.header_length, self.header_checksum)

    @classmethod
    def unpack(cls, data: bytes) -> Preamble | None:
        """The preamble `data` starts with; None where it starts with none (too short, or not
        the `.rad` magic). Checks nothing else: the reader judges version and offsets."""
        if len(data) < _PREAMBLE.size or data[:8] != MAGIC:
            return None
        _, version, offset, length, checksum = _PREAMBLE.unpack_from(data)
        return cls(version, offset, length, checksum)


class TensorEntry(msgspec.Struct, frozen=True):
    name: str
    dtype: str  # its format: a key of formats.FORMATS (a plain dtype is also a key of DTYPES)
    shape: tuple[int, ...]
    offset: int  # absolute file offset, a multiple of ALIGN
    nbytes: int
    checksum: int  # xxh3_64 of the bytes


class ExpertEntry(msgspec.Struct, frozen=True):
    """One routed expert: gate [I, H] | up [I, H] | down [H, I] in one extent."""

    layer: int
    expert: int
    dtype: str  # the pieces' format, a key of formats.FORMATS, or "GATE_UP+DOWN" (formats.expert_formats)
    intermediate: int  # I
    hidden: int  # H
    offset: int
    nbytes: int  # the three pieces' bytes (`expert_piece_bytes`), 3 * I * H * itemsize for a plain dtype
    checksum: int


class Header(msgspec.Struct, kw_only=True):
    version: int
    model: ModelConfig
    tokenizer_json: str
    chat_template: str | None
    generation: dict  # generation_config.json contents, may be {}
    source: str  # where it came from, e.g. "hf:/models/Qwen3-30B-A3B"
    synthetic: bool = False  # random weights (tools/make_synthetic): never serve as a real model
    tensors: list[TensorEntry]
    experts: list[ExpertEntry]


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of `shape` in format `dtype` (a key of formats.FORMATS)."""
    return FORMATS[dtype].nbytes(tuple(shape))


def expert_piece_bytes(dtype: str, intermediate: int, hidden: int) -> tuple[int, int, int]:
    """Bytes of an expert extent's gate [I, H], up [I, H] and down [H, I] in extent format `dtype`
    (`formats.expert_formats`: "q4_k", or "q4_k+q6_k" with down in the second)."""
    gate_up, down = expert_formats(dtype)
    gate = tensor_nbytes(gate_up, (intermediate, hidden))
    return gate, gate, tensor_nbytes(down, (hidden, intermediate))


def align_up(n: int) -> int:
    """The first multiple of ALIGN at or after n."""
    return (n + ALIGN - 1) // ALIGN * ALIGN
