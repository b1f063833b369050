"""Reading a `.rad` (layout in `rad_format.py`): `RadFile`, one validated read-only mmap.

A truncated copy loses the header (it is at the end), so `RadFile.open` reports
the byte counts and cannot list the missing tensors; an extent that runs past
the end of a file whose header survived is reported by name.
"""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path

import msgspec
import torch
import xxhash

from radianced.kernels.compact import CompactWeight
from radianced.kernels.formats import FORMATS, expert_formats
from radianced.model.config import ModelConfig
from radianced.model.rad_format import (
    ALIGN, DTYPES, RAD_VERSION, ExpertEntry, Header, Preamble, RadError, TensorEntry, expert_piece_bytes,
    tensor_nbytes,
)


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

    def tensor(self, name: str, verify: bool = True) -> torch.Tensor | CompactWeight:
        """A zero-copy view (a `CompactWeight` over the bytes for a compact format); with `verify`, its
        checksum is checked first."""
        e = self.tensor_entry(name)
        if verify:
            self._check(e.offset, e.nbytes, e.checksum, f"tensor {name}")
        return self._piece(e.offset, e.dtype, e.shape)

    # -- experts --------------------------------------------------------------

    def expert_entry(self, layer: int, expert: int) -> ExpertEntry:
        """Where expert (layer, expert) lies in the file (for O_DIRECT reads)."""
        e = self._experts.get((layer, expert))
        if e is None:
            raise RadError(f"{self.path}: no routed expert (layer {layer}, expert {expert}) in this file")
        return e

    def expert(self, layer: int, expert: int, verify: bool = True):
        """(gate [I, H], up [I, H], down [H, I]): zero-copy views into the one extent (`CompactWeight`s
        for a compact format)."""
        e = self.expert_entry(layer, expert)
        if verify:
            self._check(e.offset, e.nbytes, e.checksum, f"expert (layer {layer}, expert {expert})")
        gate, up, _ = expert_piece_bytes(e.dtype, e.intermediate, e.hidden)
        gate_up_fmt, down_fmt = expert_formats(e.dtype)
        return (self._piece(e.offset, gate_up_fmt, (e.intermediate, e.hidden)),
                self._piece(e.offset + gate, gate_up_fmt, (e.intermediate, e.hidden)),
                self._piece(e.offset + gate + up, down_fmt, (e.hidden, e.intermediate)))

    def expert_bytes(self, layer: int, expert: int, verify: bool = True) -> torch.Tensor:
        """The whole extent of expert (layer, expert) as a zero-copy [nbytes] uint8 view."""
        e = self.expert_entry(layer, expert)
        if verify:
            self._check(e.offset, e.nbytes, e.checksum, f"expert (layer {layer}, expert {expert})")
        return self._view(e.offset, torch.uint8, (e.nbytes,))

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

    def _piece(self, offset: int, fmt: str, shape: tuple[int, ...]) -> torch.Tensor | CompactWeight:
        """A tensor in format `fmt` at `offset`: a dense view, or a `CompactWeight` over its bytes."""
        if not FORMATS[fmt].compact:
            return self._view(offset, DTYPES[fmt], shape)
        nbytes = tensor_nbytes(fmt, shape)
        data = self._view(offset, torch.uint8, (nbytes,))
        return CompactWeight(fmt, tuple(shape), data if fmt == "fp8_b128" else data.view(shape[0], -1))

    def _view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        count = math.prod(shape)
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        # frombuffer keeps a reference to the mmap object, so the view outlives close()
        return torch.frombuffer(self._mapping(), dtype=dtype, count=count, offset=offset).view(shape)

    def _check(self, offset: int, nbytes: int, checksum: int, what: str) -> None:
        with memoryview(self._mapping()) as mv, mv[offset:offset + nbytes] as piece:
            actual = xxhash.xxh3_64_intdigest(piece)
        if actual != checksum:
            raise RadError(f"{self.path}: {what} is corrupt (checksum {actual:016x}, header says "
                           f"{checksum:016x}); copy the file again or re-run radiancectl convert")


def _read_header(path: Path, f, size: int) -> Header:
    pre = f.read(Preamble.SIZE)
    preamble = Preamble.unpack(pre)
    if preamble is None:
        hint = " (it is a GGUF file: convert it with `radiancectl convert`)" if pre[:4] == b"GGUF" else ""
        raise RadError(f"{path}: not a .rad file{hint}")
    version, hoff, hlen, hsum = (preamble.version, preamble.header_offset, preamble.header_length,
                                 preamble.header_checksum)
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
    items = [(t.offset, t.nbytes, t.dtype, t, f"tensor {t.name}") for t in header.tensors]
    items += [(e.offset, e.nbytes, e.dtype, e, f"expert (layer {e.layer}, expert {e.expert})") for e in header.experts]
    for offset, nbytes, dtype, entry, what in sorted(items, key=lambda item: item[:2]):
        try:
            pieces = [(entry.dtype, entry.shape)] if isinstance(entry, TensorEntry) else _expert_pieces(entry)
            expected = sum(tensor_nbytes(fmt, shape) for fmt, shape in pieces)
        except KeyError:
            raise RadError(f"{path}: {what} has unknown dtype {dtype!r}; re-convert with this radianced") from None
        except ValueError as err:
            raise RadError(f"{path}: {what}: {err}") from None
        if nbytes != expected:
            raise RadError(f"{path}: {what} records {nbytes} bytes but its shape needs {expected}")
        if offset % ALIGN or offset < ALIGN:
            raise RadError(f"{path}: {what} starts at byte {offset}, not on a {ALIGN}-byte boundary after the preamble")
        if offset + nbytes > size:
            raise RadError(f"{path}: {what} (bytes {offset}..{offset + nbytes}) runs past the end of the file "
                           f"({size} bytes): the file is truncated. Copy it again or re-run radiancectl convert")


def _expert_pieces(e: ExpertEntry) -> list[tuple[str, tuple[int, int]]]:
    """(format, shape) of an extent's gate, up and down; KeyError for an unknown extent format."""
    try:
        gate_up, down = expert_formats(e.dtype)
    except ValueError:
        raise KeyError(e.dtype) from None
    i, h = e.intermediate, e.hidden
    return [(gate_up, (i, h)), (gate_up, (i, h)), (down, (h, i))]
