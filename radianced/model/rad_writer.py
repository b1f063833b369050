"""Writing a `.rad` (layout in `rad_format.py`): tensors streamed in, the header last.

`RadWriter` never holds more than one tensor: each `add_*` call writes its
bytes at once, and the header (the index of every extent) goes at the end when
the writer closes. A `.rad` appears at its path only when it is complete.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import msgspec
import torch
import xxhash

from radianced.kernels.compact import CompactWeight
from radianced.model.config import ModelConfig
from radianced.model.rad_format import (
    ALIGN, DTYPE_NAMES, DTYPES, RAD_VERSION, ExpertEntry, Header, Preamble, RadError, TensorEntry, align_up,
    expert_piece_bytes, tensor_nbytes,
)

Piece = torch.Tensor | CompactWeight


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (bf16/fp8 have no numpy dtype)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


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
        self._check_name(name)
        dname = self._dtype_name(dtype, f"tensor {name}")
        self._add(name, dname, shape, *self._write_pieces(chunks, dtype, f"tensor {name}"))

    def add_compact(self, name: str, w: CompactWeight) -> None:
        """Write the compact matrix `w` as tensor `name`: its bytes as they are, its format in the header."""
        self._check_name(name)
        self._add(name, w.fmt, w.shape, *self._write_pieces([w.data], torch.uint8, f"tensor {name}"))

    def add_expert(self, layer: int, expert: int, gate: Piece, up: Piece, down: Piece) -> None:
        """Write routed expert (layer, expert) as one extent: gate [I, H] | up [I, H] | down [H, I],
        three tensors of one dtype or three `CompactWeight`s (scales inside each piece): gate and up of
        one format, down of that format or another compact one (recorded as "gate_up+down")."""
        what = f"expert (layer {layer}, expert {expert})"
        if (layer, expert) in self._expert_ids:
            self._fail(f"{what} added twice")
        if len(gate.shape) != 2 or tuple(up.shape) != tuple(gate.shape) or tuple(down.shape) != tuple(gate.shape)[::-1]:
            self._fail(f"{what}: expected gate [I, H], up [I, H], down [H, I]; got gate {list(gate.shape)}, "
                       f"up {list(up.shape)}, down {list(down.shape)}")
        kinds = [p.fmt if isinstance(p, CompactWeight) else p.dtype for p in (gate, up, down)]
        mixed_down = all(isinstance(p, CompactWeight) for p in (gate, up, down)) and kinds[0] == kinds[1]
        if len(set(kinds)) > 1 and not mixed_down:
            word, fix = (("dtypes", "cast them to one dtype") if all(isinstance(k, torch.dtype) for k in kinds)
                         else ("formats", "give all three in one format"))
            self._fail(f"{what}: gate/up/down {word} differ ({', '.join(map(str, kinds))}); {fix}")
        if isinstance(gate, CompactWeight):
            dname = gate.fmt if down.fmt == gate.fmt else f"{gate.fmt}+{down.fmt}"
            pieces, dtype = [gate.data, up.data, down.data], torch.uint8
        else:
            dname, pieces, dtype = self._dtype_name(gate.dtype, what), [gate, up, down], gate.dtype
        inter, hidden = gate.shape
        offset, written, h = self._write_pieces(pieces, dtype, what)
        if written != sum(expert_piece_bytes(dname, inter, hidden)):
            self._fail(f"{what}: pieces hold {written} bytes, {dname} [{inter}, {hidden}] x 3 needs "
                       f"{sum(expert_piece_bytes(dname, inter, hidden))}")
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
            self._f.write(Preamble(RAD_VERSION, offset, len(blob), xxhash.xxh3_64_intdigest(blob)).pack())
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

    def _check_name(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            self._fail(f"tensor name must be a non-empty string, got {name!r}")
        if name in self._names:
            self._fail(f"tensor {name} added twice")

    def _add(self, name: str, dname: str, shape: tuple[int, ...], start: int, written: int, h: int) -> None:
        """Record tensor `name` written at `start`, after checking its bytes against its format and shape."""
        try:
            expected = tensor_nbytes(dname, shape)
        except ValueError as e:
            self._fail(f"tensor {name}: {e}")
        if written != expected:
            self._fail(f"tensor {name}: pieces hold {written} bytes, shape {list(shape)} needs {expected}")
        self._names.add(name)
        self._tensors.append(TensorEntry(name, dname, tuple(int(s) for s in shape), start, written, h))

    def _dtype_name(self, dtype: torch.dtype, what: str) -> str:
        if dtype not in DTYPE_NAMES:
            self._fail(f"{what} has dtype {dtype}, which a .rad cannot hold; cast it to one of "
                       f"{', '.join(DTYPES)}")
        return DTYPE_NAMES[dtype]

    def _start_extent(self) -> int:
        """Pad the file to the next ALIGN boundary; returns that offset."""
        if self._done:
            raise RadError(f"{self.path}: the writer is already closed")
        pad = align_up(self._pos) - self._pos
        if pad:
            self._write(bytes(pad))
        return self._pos

    def _write_pieces(self, pieces: Iterable[torch.Tensor], dtype: torch.dtype, what: str) -> tuple[int, int, int]:
        """Write `pieces` from the next ALIGN boundary: (where they start, bytes written, their xxh3_64)."""
        h = xxhash.xxh3_64()
        start = self._start_extent()
        for p in pieces:
            if p.dtype != dtype:
                self._fail(f"{what}: a piece has dtype {p.dtype}, expected {dtype}")
            data = _as_bytes(p.detach().to("cpu").contiguous())
            h.update(data)
            self._write(data)
        return start, self._pos - start, h.intdigest()

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
