"""The expert profile: routing counts per (layer, expert), stored beside the model.

`<model>.expert-profile.bin` (see `profile_path`) ranks the routed experts by
how often steps routed to them; start-up pre-fills the expert slots in that
order, and a running daemon keeps counting and can save an updated profile.

Layout (little-endian):

    [0, 48)   preamble: b"RADPROF\\0" | u32 version | u32 body length |
              u64 model checksum | u64 steps | u64 xxh3_64(body) | u64 xxh3_64(bytes 0..40)
    [48, ...) body: msgpack `_Body` (the model's MoE layers, its experts per
              layer, and the counted pairs (layer, expert, count) in rank order)

The model checksum is the `.rad` header's xxh3_64 from the file's preamble
(`model_checksum`): a profile made for another file, even a re-conversion of
the same model, is refused, as is one whose shape disagrees with the model
or whose bytes do not match their checksums. Every refusal is a ProfileError
naming the file and saying what to do.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec
import xxhash

from radianced.model.rad_format import Preamble as RadPreamble

MAGIC = b"RADPROF\0"
VERSION = 1
SUFFIX = ".expert-profile.bin"
_PRE = struct.Struct("<8sIIQQQ")  # magic, version, body length, model checksum, steps, body xxh3
_SUM = struct.Struct("<Q")  # xxh3 of the 40 bytes before it
PREAMBLE_BYTES = _PRE.size + _SUM.size  # 48

Key = tuple[int, int]


class ProfileError(Exception):
    """A profile cannot be read, or belongs to another model; the message says what to do."""


class _Body(msgspec.Struct, array_like=True):
    moe_layers: list[int]
    num_experts: int
    pairs: list[tuple[int, int, int]]  # (layer, expert, count), rank order, count > 0


def profile_path(model_path: str | os.PathLike) -> Path:
    """`m.rad` -> `m.rad.expert-profile.bin`, beside the model."""
    p = Path(model_path)
    return p.with_name(p.name + SUFFIX)


def model_checksum(model_path: str | os.PathLike) -> int:
    """The `.rad` header checksum from the file's preamble: the model file's identity."""
    path = Path(model_path)
    try:
        with open(path, "rb") as f:
            preamble = RadPreamble.unpack(f.read(RadPreamble.SIZE))
    except OSError as e:
        raise ProfileError(f"{path}: cannot read the model: {e.strerror or e}") from None
    if preamble is None:
        raise ProfileError(f"{path}: not a .rad file")
    return preamble.header_checksum


class Profile:
    """Routing counts of one model. Mutable: `add` counts, `merge` folds another profile in.

    model_checksum, moe_layers and num_experts say which model it belongs to;
    `steps` counts the routing steps recorded (informational).
    """

    def __init__(self, model_checksum: int, moe_layers: Sequence[int], num_experts: int,
                 counts: dict[Key, int] | None = None, steps: int = 0):
        self.model_checksum = model_checksum
        self.moe_layers = tuple(moe_layers)
        self.num_experts = num_experts
        self.steps = steps
        self._index = {layer: i for i, layer in enumerate(self.moe_layers)}
        self._counts = [0] * (len(self.moe_layers) * num_experts)  # layer-major, file order
        for (layer, expert), n in (counts or {}).items():
            self._counts[self._slot(layer, expert)] += n

    @classmethod
    def for_model(cls, rad) -> Profile:
        """An empty profile for an open `RadFile`."""
        return cls(model_checksum(rad.path), rad.model.moe_layers, rad.model.num_experts)

    # -- counting --------------------------------------------------------------

    def add(self, layer: int, counts: Iterable[int]) -> None:
        """Add one layer's per-expert counts (e.g. a step's routed tokens per expert: len num_experts)."""
        counts = list(counts)
        if len(counts) != self.num_experts:
            raise ValueError(f"layer {layer}: {len(counts)} counts for {self.num_experts} experts")
        base = self._slot(layer, 0)
        for e, n in enumerate(counts):
            if n < 0:
                raise ValueError(f"layer {layer}, expert {e}: negative count {n}")
            self._counts[base + e] += int(n)

    def count(self, layer: int, expert: int) -> int:
        return self._counts[self._slot(layer, expert)]

    def merge(self, other: Profile) -> None:
        """Add `other`'s counts and steps; it must belong to the same model (else ProfileError)."""
        _check_model("the merged profile", other, self.model_checksum, self.moe_layers, self.num_experts)
        self._counts = [a + b for a, b in zip(self._counts, other._counts)]
        self.steps += other.steps

    # -- ranking ---------------------------------------------------------------

    def ranked(self) -> list[tuple[int, int, int]]:
        """(layer, expert, count) of every counted expert, most routed first; ties in file order."""
        E = self.num_experts
        order = sorted((i for i, n in enumerate(self._counts) if n), key=lambda i: -self._counts[i])
        return [(self.moe_layers[i // E], i % E, self._counts[i]) for i in order]

    def rank(self) -> list[Key]:
        """The counted experts, most routed first (ties in file order); what `placement.place` takes.
        Experts never routed are left out: the placement puts them after, in file order."""
        return [(layer, expert) for layer, expert, _ in self.ranked()]

    def __len__(self) -> int:
        """Experts with a non-zero count."""
        return sum(1 for n in self._counts if n)

    def line(self, path: str | os.PathLike) -> str:
        """The start-up log line, e.g. `profile m.rad.expert-profile.bin: 24576 ranked pairs`."""
        return f"profile {Path(path).name}: {len(self)} ranked pairs"

    # -- the file --------------------------------------------------------------

    def to_bytes(self) -> bytes:
        body = msgspec.msgpack.encode(_Body(list(self.moe_layers), self.num_experts,
                                            [tuple(p) for p in self.ranked()]))
        pre = _PRE.pack(MAGIC, VERSION, len(body), self.model_checksum, self.steps, xxhash.xxh3_64_intdigest(body))
        return pre + _SUM.pack(xxhash.xxh3_64_intdigest(pre)) + body

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: a fresh temp file beside `path` (`mkstemp`: an unpredictable name made
        with O_EXCL, so a link planted in a shared folder is never followed), synced, renamed over
        it. Raises ProfileError naming the path (and, when refused, the folder that needs write
        access)."""
        path = Path(path)
        tmp = None
        try:
            fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            tmp = Path(name)
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the profile from other readers
            with open(fd, "wb") as f:
                f.write(self.to_bytes())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _sync_folder(path.parent)
        except OSError as e:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
            why = e.strerror or str(e)
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                why += (f": this user (uid {os.geteuid()}) cannot write in {path.parent}; give it write access "
                        f"there or choose another path with --out")
            raise ProfileError(f"{path}: cannot write the profile: {why}") from None

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "profile") -> Profile:
        """Decode and check a profile's bytes (no model check: see `load`)."""
        if len(data) < PREAMBLE_BYTES or data[:8] != MAGIC:
            raise ProfileError(f"{where}: not an expert profile; re-run radiancectl profile")
        magic, version, body_len, checksum, steps, body_sum = _PRE.unpack_from(data)
        if version != VERSION:
            raise ProfileError(f"{where}: profile format version {version}; this radianced reads version "
                               f"{VERSION}. Re-run radiancectl profile")
        if _SUM.unpack_from(data, _PRE.size)[0] != xxhash.xxh3_64_intdigest(data[:_PRE.size]):
            raise ProfileError(f"{where}: the profile header is corrupt (checksum mismatch); re-run "
                               f"radiancectl profile or delete the file")
        body = data[PREAMBLE_BYTES:]
        if len(body) != body_len:
            raise ProfileError(f"{where}: the profile is truncated ({len(body)} of {body_len} body bytes); "
                               f"re-run radiancectl profile or delete the file")
        if xxhash.xxh3_64_intdigest(body) != body_sum:
            raise ProfileError(f"{where}: the profile is corrupt (body checksum mismatch); re-run "
                               f"radiancectl profile or delete the file")
        try:
            b = msgspec.msgpack.decode(body, type=_Body)
        except msgspec.DecodeError as e:
            raise ProfileError(f"{where}: the profile does not decode ({e}); re-run radiancectl profile") from None
        p = cls(checksum, b.moe_layers, b.num_experts, steps=steps)
        for layer, expert, n in b.pairs:
            if layer not in p._index or not 0 <= expert < b.num_experts or n <= 0:
                raise ProfileError(f"{where}: the profile lists (layer {layer}, expert {expert}, count {n}), "
                                   f"outside its own shape; re-run radiancectl profile")
            p._counts[p._slot(layer, expert)] += n
        return p

    @classmethod
    def load(cls, path: str | os.PathLike, *, model_checksum: int, moe_layers: Sequence[int],
             num_experts: int) -> Profile:
        """Read `path` and check it belongs to the model described. Raises ProfileError."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ProfileError(f"{path}: cannot read the profile: {e.strerror or e}") from None
        p = cls.from_bytes(data, str(path))
        _check_model(str(path), p, model_checksum, tuple(moe_layers), num_experts)
        return p

    @classmethod
    def load_for(cls, rad, path: str | os.PathLike | None = None) -> Profile:
        """The profile of an open `RadFile` (default path: `profile_path(rad.path)`)."""
        m = rad.model
        return cls.load(path or profile_path(rad.path), model_checksum=model_checksum(rad.path),
                        moe_layers=m.moe_layers, num_experts=m.num_experts)

    # -- internals -------------------------------------------------------------

    def _slot(self, layer: int, expert: int) -> int:
        i = self._index.get(layer)
        if i is None or not 0 <= expert < self.num_experts:
            raise ValueError(f"(layer {layer}, expert {expert}) is not a routed expert of this model "
                             f"(MoE layers {list(self.moe_layers)}, {self.num_experts} experts each)")
        return i * self.num_experts + expert


def _sync_folder(folder: Path) -> None:
    """fsync a folder, so a rename in it survives a crash."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_model(what: str, p: Profile, checksum: int, moe_layers: tuple[int, ...], num_experts: int) -> None:
    """Raise ProfileError unless profile `p` belongs to the model described."""
    if p.model_checksum != checksum:
        raise ProfileError(f"{what} was made for another model file (its model checksum {p.model_checksum:016x}, "
                           f"this model's {checksum:016x}); re-run radiancectl profile for this model or "
                           f"delete the profile")
    if p.moe_layers != tuple(moe_layers) or p.num_experts != num_experts:
        raise ProfileError(f"{what} has MoE layers {list(p.moe_layers)} x {p.num_experts} experts, this model "
                           f"{list(moe_layers)} x {num_experts}; re-run radiancectl profile for this model")
