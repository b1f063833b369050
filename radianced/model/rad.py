"""The `.rad` model container: one file, written as a stream, read through one mmap.

Layout (all integers little-endian):

    [0, 4096)      preamble: b"RADIANCE" | u32 version | u64 header offset |
                   u64 header length | u64 xxh3_64(header) | zeros
    [4096, ...)    tensor data; every tensor and every expert extent starts at a
                   multiple of ALIGN (4096), so each can be read with O_DIRECT
    header         msgpack `Header` at the end, after the last extent (its offset
                   is aligned too); the writer patches the preamble when it closes

The header sits at the end so a converter can stream tensor by tensor without
knowing the index in advance. A routed expert (layer, expert) is ONE extent:
gate [I, H] | up [I, H] | down [H, I], same dtype, no padding between the
pieces, so a single read fetches it. Each tensor and extent carries the xxh3_64
of its bytes.

A truncated copy loses the header (it is at the end), so `RadFile.open` reports
the byte counts and cannot list the missing tensors; an extent that runs past
the end of a file whose header survived is reported by name.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from pathlib import Path
from typing import Iterable

import msgspec
import torch
import xxhash

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


class TensorEntry(msgspec.Struct, frozen=True):
    name: str
    dtype: str  # a key of DTYPES
    shape: tuple[int, ...]
    offset: int  # absolute file offset, a multiple of ALIGN
    nbytes: int
    checksum: int  # xxh3_64 of the bytes


class ExpertEntry(msgspec.Struct, frozen=True):
    """One routed expert: gate [I, H] | up [I, H] | down [H, I] in one extent."""

    layer: int
    expert: int
    dtype: str
    intermediate: int  # I
    hidden: int  # H
    offset: int
    nbytes: int  # 3 * I * H * itemsize
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


class RadError(Exception):
    """A `.rad` cannot be written or read; the message names the file and tensor and what to do."""


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (bf16/fp8 have no numpy dtype)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RadWriter:
    """Streams tensors into `<path>.tmp`; on a clean `close()` writes the header and renames to `path`.

    Use it as a context manager. Each `add_*` call writes its bytes at once, so
    memory stays at one tensor. An exception inside the `with` block, or any
    RadError raised by the writer (which then refuses further calls), removes
    the temp file: no partial `.rad` is ever left at `path`, and an existing
    file at `path` is replaced only on success.
    """

    def __init__(self, path: str | os.PathLike, *, model: ModelConfig, tokenizer_json: str,
                 chat_template: str | None, generation: dict, source: str, synthetic: bool = False):
        self.path = Path(path)
        self.tmp_path = self.path.with_name(self.path.name + ".tmp")
        if not self.path.parent.is_dir():
            raise RadError(f"{self.path}: folder {self.path.parent} does not exist; create it first")
        self._meta = dict(model=model, tokenizer_json=tokenizer_json, chat_template=chat_template,
                          generation=dict(generation), source=source, synthetic=synthetic)
        self._tensors: list[TensorEntry] = []
        self._experts: list[ExpertEntry] = []
        self._names: set[str] = set()
        self._expert_ids: set[tuple[int, int]] = set()
        try:
            self._f = open(self.tmp_path, "wb")
            self._f.write(bytes(ALIGN))  # preamble placeholder, patched by close()
        except OSError as e:
            self._discard()
            raise RadError(f"{self.path}: cannot write {self.tmp_path}: {e.strerror}") from None
        self._pos = ALIGN
        self._done = False

    # -- writing --------------------------------------------------------------

    def add_tensor(self, name: str, t: torch.Tensor) -> None:
        """Write `t` now (its dtype kept; a contiguous copy is made only if needed)."""
        self.add_tensor_chunks(name, t.dtype, tuple(t.shape), [t])

    def add_tensor_chunks(self, name: str, dtype: torch.dtype, shape: tuple[int, ...],
                          chunks: Iterable[torch.Tensor]) -> None:
        """Write one tensor given as consecutive row-major pieces (e.g. row blocks of a large matrix).

        For a tensor too large to hold whole (or whole twice, when casting): the
        pieces are written as they come and must add up to exactly `shape`.
        """
        if not isinstance(name, str) or not name:
            self._fail(f"tensor name must be a non-empty string, got {name!r}")
        if name in self._names:
            self._fail(f"tensor {name} added twice")
        dname = self._dtype_name(dtype, f"tensor {name}")
        expected = math.prod(shape) * _itemsize(dname)
        offset = self._start_extent()
        written, h = self._write_pieces(chunks, dtype, f"tensor {name}")
        if written != expected:
            self._fail(f"tensor {name}: pieces hold {written} bytes, shape {list(shape)} needs {expected}")
        self._names.add(name)
        self._tensors.append(TensorEntry(name, dname, tuple(int(s) for s in shape), offset, written, h))

    def add_expert(self, layer: int, expert: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        """Write routed expert (layer, expert) as one extent: gate [I, H] | up [I, H] | down [H, I]."""
        what = f"expert (layer {layer}, expert {expert})"
        if (layer, expert) in self._expert_ids:
            self._fail(f"{what} added twice")
        if gate.dim() != 2 or up.shape != gate.shape or down.shape != gate.shape[::-1]:
            self._fail(f"{what}: expected gate [I, H], up [I, H], down [H, I]; got gate {list(gate.shape)}, "
                       f"up {list(up.shape)}, down {list(down.shape)}")
        if not (gate.dtype == up.dtype == down.dtype):
            self._fail(f"{what}: gate/up/down dtypes differ ({gate.dtype}, {up.dtype}, {down.dtype}); "
                       f"cast them to one dtype")
        dname = self._dtype_name(gate.dtype, what)
        inter, hidden = gate.shape
        offset = self._start_extent()
        written, h = self._write_pieces([gate, up, down], gate.dtype, what)
        self._expert_ids.add((layer, expert))
        self._experts.append(ExpertEntry(layer, expert, dname, inter, hidden, offset, written, h))

    # -- finishing ------------------------------------------------------------

    def close(self) -> None:
        """Write the header, patch the preamble, fsync, and rename `<path>.tmp` to `path`."""
        if self._done:
            return
        header = Header(version=RAD_VERSION, tensors=self._tensors, experts=self._experts, **self._meta)
        try:
            blob = msgspec.msgpack.encode(header)
            offset = self._start_extent()
            self._f.write(blob)
            self._f.seek(0)
            self._f.write(_PREAMBLE.pack(MAGIC, RAD_VERSION, offset, len(blob), xxhash.xxh3_64_intdigest(blob)))
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self.tmp_path, self.path)
            _fsync_dir(self.path.parent)
        except OSError as e:
            self._fail(f"cannot finish: {e.strerror or e}")
        self._done = True

    def abort(self) -> None:
        """Drop everything written so far; `path` is left as it was."""
        if not self._done:
            self._discard()
            self._done = True

    def __enter__(self) -> RadWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # -- internals ------------------------------------------------------------

    def _dtype_name(self, dtype: torch.dtype, what: str) -> str:
        if dtype not in DTYPE_NAMES:
            self._fail(f"{what} has dtype {dtype}, which a .rad cannot hold; cast it to one of "
                       f"{', '.join(DTYPES)}")
        return DTYPE_NAMES[dtype]

    def _start_extent(self) -> int:
        """Pad the file to the next ALIGN boundary; returns that offset."""
        if self._done:
            raise RadError(f"{self.path}: the writer is already closed")
        pad = _align_up(self._pos) - self._pos
        if pad:
            self._write(bytes(pad))
        return self._pos

    def _write_pieces(self, pieces: Iterable[torch.Tensor], dtype: torch.dtype, what: str) -> tuple[int, int]:
        h = xxhash.xxh3_64()
        start = self._pos
        for p in pieces:
            if p.dtype != dtype:
                self._fail(f"{what}: a piece has dtype {p.dtype}, expected {dtype}")
            data = _as_bytes(p.detach().to("cpu").contiguous())
            h.update(data)
            self._write(data)
        return self._pos - start, h.intdigest()

    def _write(self, data) -> None:
        try:
            self._f.write(data)
        except OSError as e:
            self._fail(f"write failed at byte {self._pos}: {e.strerror or e}")
        self._pos += len(data)

    def _fail(self, message: str):
        self._discard()
        self._done = True
        raise RadError(f"{self.path}: {message}")

    def _discard(self) -> None:
        f = getattr(self, "_f", None)
        if f is not None and not f.closed:
            f.close()
        self.tmp_path.unlink(missing_ok=True)


class RadFile:
    """A validated `.rad`, mapped read-only (copy-on-write): tensors are zero-copy views.

    `open` checks the preamble, the header checksum and that every extent lies
    inside the file; data checksums are checked per tensor on access
    (`verify=True`) or all at once by `verify()`. Views stay valid after
    `close()`: the mapping is released when the last view is gone.
    """

    def __init__(self, path: Path, header: Header, mm: mmap.mmap):
        self.path = path
        self.header = header
        self._mm = mm
        self._tensors = {t.name: t for t in header.tensors}
        self._experts = {(e.layer, e.expert): e for e in header.experts}

    @property
    def model(self) -> ModelConfig:
        return self.header.model

    @classmethod
    def open(cls, path: str | os.PathLike) -> RadFile:
        path = Path(path)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                header = _read_header(path, f, size)
                _check_extents(path, header, size)
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError as e:
            raise RadError(f"{path}: cannot open: {e.strerror or e}") from None
        return cls(path, header, mm)

    # -- tensors --------------------------------------------------------------

    def tensor_names(self) -> list[str]:
        return [t.name for t in self.header.tensors]

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_entry(self, name: str) -> TensorEntry:
        entry = self._tensors.get(name)
        if entry is None:
            raise RadError(f"{self.path}: no tensor named {name!r} (the file has {len(self._tensors)} tensors; "
                           f"was it converted from the right model?)")
        return entry

    def tensor(self, name: str, verify: bool = True) -> torch.Tensor:
        """A zero-copy view; with `verify`, its checksum is checked first."""
        e = self.tensor_entry(name)
        if verify:
            self._check(e.offset, e.nbytes, e.checksum, f"tensor {name}")
        return self._view(e.offset, e.dtype, e.shape)

    # -- experts --------------------------------------------------------------

    def expert_entry(self, layer: int, expert: int) -> ExpertEntry:
        """Where expert (layer, expert) lies in the file (for O_DIRECT reads)."""
        e = self._experts.get((layer, expert))
        if e is None:
            raise RadError(f"{self.path}: no routed expert (layer {layer}, expert {expert}) in this file")
        return e

    def expert(self, layer: int, expert: int, verify: bool = True):
        """(gate [I, H], up [I, H], down [H, I]): zero-copy views into the one extent."""
        e = self.expert_entry(layer, expert)
        if verify:
            self._check(e.offset, e.nbytes, e.checksum, f"expert (layer {layer}, expert {expert})")
        piece = e.nbytes // 3
        return (self._view(e.offset, e.dtype, (e.intermediate, e.hidden)),
                self._view(e.offset + piece, e.dtype, (e.intermediate, e.hidden)),
                self._view(e.offset + 2 * piece, e.dtype, (e.hidden, e.intermediate)))

    # -- whole file -----------------------------------------------------------

    def verify(self) -> None:
        """Check every tensor and expert checksum, in file order; raises RadError at the first bad one."""
        items = [(t.offset, t.nbytes, t.checksum, f"tensor {t.name}") for t in self.header.tensors]
        items += [(e.offset, e.nbytes, e.checksum, f"expert (layer {e.layer}, expert {e.expert})")
                  for e in self.header.experts]
        for offset, nbytes, checksum, what in sorted(items):
            self._check(offset, nbytes, checksum, what)

    def close(self) -> None:
        """Drop this object's mapping; tensor views already handed out keep it alive until they go."""
        self._mm = None

    def __enter__(self) -> RadFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ------------------------------------------------------------

    def _mapping(self) -> mmap.mmap:
        if self._mm is None:
            raise RadError(f"{self.path}: the file is closed")
        return self._mm

    def _view(self, offset: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        count = math.prod(shape)
        if count == 0:
            return torch.empty(shape, dtype=DTYPES[dtype])
        # frombuffer keeps a reference to the mmap object, so the view outlives close()
        return torch.frombuffer(self._mapping(), dtype=DTYPES[dtype], count=count, offset=offset).view(shape)

    def _check(self, offset: int, nbytes: int, checksum: int, what: str) -> None:
        with memoryview(self._mapping()) as mv, mv[offset:offset + nbytes] as piece:
            actual = xxhash.xxh3_64_intdigest(piece)
        if actual != checksum:
            raise RadError(f"{self.path}: {what} is corrupt (checksum {actual:016x}, header says "
                           f"{checksum:016x}); copy the file again or re-run radiancectl convert")


def _read_header(path: Path, f, size: int) -> Header:
    pre = f.read(_PREAMBLE.size)
    if len(pre) < _PREAMBLE.size or pre[:8] != MAGIC:
        hint = " (it is a GGUF file: convert it with `radiancectl convert`)" if pre[:4] == b"GGUF" else ""
        raise RadError(f"{path}: not a .rad file{hint}")
    _, version, hoff, hlen, hsum = _PREAMBLE.unpack(pre)
    if version != RAD_VERSION:
        raise RadError(f"{path}: .rad format version {version}; this radianced reads version {RAD_VERSION}. "
                       f"Re-convert the model with this radianced")
    if hoff == 0 or hlen == 0:
        raise RadError(f"{path}: the header was never written (an interrupted conversion); re-run radiancectl convert")
    if hoff + hlen > size:
        raise RadError(f"{path}: the file is truncated: it is {size} bytes but its header ends at byte "
                       f"{hoff + hlen}; the tensor index is at the end and was lost with it. "
                       f"Copy the file again or re-run radiancectl convert")
    f.seek(hoff)
    blob = f.read(hlen)
    if xxhash.xxh3_64_intdigest(blob) != hsum:
        raise RadError(f"{path}: the header is corrupt (checksum mismatch); copy the file again or re-run "
                       f"radiancectl convert")
    try:
        header = msgspec.msgpack.decode(blob, type=Header)
    except msgspec.DecodeError as e:  # checksum matched, so a writer bug or an incompatible build
        raise RadError(f"{path}: the header does not decode ({e}); re-convert with this radianced") from None
    if header.version != version:
        raise RadError(f"{path}: header version {header.version} disagrees with the preamble ({version})")
    return header


def _check_extents(path: Path, header: Header, size: int) -> None:
    """Every extent aligned, sized for its shape, and inside the file; names the first one that is not."""
    items = []
    for t in header.tensors:
        items.append((t.offset, t.nbytes, t.dtype, math.prod(t.shape), f"tensor {t.name}"))
    for e in header.experts:
        items.append((e.offset, e.nbytes, e.dtype, 3 * e.intermediate * e.hidden,
                      f"expert (layer {e.layer}, expert {e.expert})"))
    for offset, nbytes, dtype, count, what in sorted(items):
        if dtype not in DTYPES:
            raise RadError(f"{path}: {what} has unknown dtype {dtype!r}; re-convert with this radianced")
        if nbytes != count * _itemsize(dtype):
            raise RadError(f"{path}: {what} records {nbytes} bytes but its shape needs {count * _itemsize(dtype)}")
        if offset % ALIGN or offset < ALIGN:
            raise RadError(f"{path}: {what} starts at byte {offset}, not on a {ALIGN}-byte boundary after the preamble")
        if offset + nbytes > size:
            raise RadError(f"{path}: {what} (bytes {offset}..{offset + nbytes}) runs past the end of the file "
                           f"({size} bytes): the file is truncated. Copy it again or re-run radiancectl convert")
