"""The host pool: routed experts in host RAM, read by the GPU over PCIe.

`HostPool.create(rad, keys, ...)` allocates one row per expert (the extent
rounded up to 4 KiB, or the receipt's page), fills the rows with O_DIRECT reads
of the `.rad` through `tiers.disk` (the bytes never pass through the page
cache, so the pool is the only copy in RAM), checks every extent's checksum,
and registers the memory with CUDA when a GPU is present (`cudaHostRegister`,
portable and mapped: the pointer table can hold its addresses). On the CPU
backend the pool is plain memory and everything else is the same.

Rows hold the extents as the file does: gate | up | down in the experts' dtype,
or, for compact experts (`kernels/formats.py`), the extent's bytes (uint8 rows,
extents of several formats side by side: a row holds the widest), which the
MoE ops dequantize when they read them.

Backing:

- anonymous memory (default): private to this process;
- `ram_dir=DIR` (`ram=DIR` placements): the pool is a file in the tmpfs DIR,
  mapped MAP_SHARED, so daemons on one host share one copy. The file is
  fallocated to its full size first, so a tmpfs too small fails at start with
  a message, not with SIGBUS on a later touch. A lock file serialises start-up
  and a ready marker (keyed by the model checksum and the pool layout) says the
  file is filled: of two daemons starting together one fills it, the other
  waits for the lock, sees the marker and maps the same file. The file stays
  in DIR after the daemons exit, so a restart maps it at once; delete it to
  give the memory back.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch
import xxhash

from radianced.kernels.formats import is_compact
from radianced.kernels.pinned import PinError, register_pinned
from radianced.model.rad_format import DTYPES
from radianced.tiers.aligned import ALIGN, align_up
from radianced.tiers.disk import DEPTH, DiskError, DiskReader
from radianced.tiers.faults import Faults
from radianced.tiers.profile import model_checksum
from radianced.tmpfs import tmpfs_refusal

MiB = 1 << 20

Key = tuple[int, int]


class HostPoolError(RuntimeError):
    """The pool cannot be set up (memory, tmpfs, model file); the message says what to do."""


@dataclass(frozen=True)
class FillStats:
    experts: int
    bytes: int
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


class _Ready(msgspec.Struct):
    """The ready marker beside a tmpfs pool file: written only once the file is filled and checked."""

    version: int
    model_checksum: int
    layout: int
    size: int
    inode: int


class HostPool:
    """One row per expert in `keys` order; `tensor[r, :elems]` is expert keys[r]'s extent.

    Rows are `row_bytes` apart (a multiple of 4096). Views stay valid while the
    pool is open; `close()` unregisters the memory from CUDA.
    """

    def __init__(self, keys: tuple[Key, ...], mm: mmap.mmap | None, row_bytes: int, dtype: torch.dtype,
                 elems: int, *, pinned: bool, path: Path | None, filled_here: bool, fill: FillStats | None):
        self.keys = keys
        self.row_bytes = row_bytes
        self.dtype = dtype
        self.elems = elems  # 3 * I * H, or the widest compact extent's bytes
        self.pinned = pinned
        self.path = path  # the tmpfs file, or None for anonymous memory
        self.filled_here = filled_here  # False: another process had filled the shared file
        self.fill = fill
        self._rows = {k: i for i, k in enumerate(keys)}
        self._mm = mm
        self._unpin: weakref.finalize | None = None
        itemsize = torch.empty((), dtype=dtype).element_size()
        if mm is None:
            self._bytes = torch.empty((0, row_bytes), dtype=torch.uint8)
        else:  # [rows, row_bytes] uint8 over the mapping, no copy
            self._bytes = torch.frombuffer(mm, dtype=torch.uint8).view(len(keys), row_bytes)
        self.tensor = self._bytes.view(dtype)  # [rows, row_bytes // itemsize]
        assert self.tensor.shape[1] * itemsize == row_bytes

    # -- creating ----------------------------------------------------------------

    @classmethod
    def create(cls, rad, keys, *, row_bytes: int | None = None, capacity_bytes: int | None = None,
               ram_dir: str | os.PathLike | None = None, pin: bool | None = None, depth: int = DEPTH,
               verify: bool = True, faults: Faults | None = None) -> HostPool:
        """A pool of the experts `keys` of the open `RadFile` `rad`, filled and checked.

        row_bytes: row size (default: the extent rounded up to 4 KiB; give the
        receipt's `page_bytes` to match its host-pool line). capacity_bytes:
        `--host-pool-mib` in bytes; more rows than fit raise HostPoolError.
        pin: register with CUDA (default: when CUDA is available). Raises
        HostPoolError when memory, the tmpfs or the model file fails.
        """
        keys = tuple((int(k[0]), int(k[1])) for k in keys)
        dtype, nbytes = _row_type(rad, keys)
        elems = nbytes // max(1, torch.empty((), dtype=dtype).element_size())
        row_bytes = row_bytes or max(ALIGN, align_up(nbytes))
        if row_bytes % ALIGN or row_bytes < align_up(nbytes):
            raise HostPoolError(f"row of {row_bytes} bytes: must be a multiple of {ALIGN} holding the "
                                f"{align_up(nbytes)} bytes an O_DIRECT read of one expert writes")
        size = len(keys) * row_bytes
        if capacity_bytes is not None and size > capacity_bytes:
            raise HostPoolError(f"{len(keys)} experts x {row_bytes / MiB:.2f} MiB = {size / MiB:.2f} MiB do not fit "
                                f"--host-pool-mib {capacity_bytes // MiB} (it holds {capacity_bytes // row_bytes})")
        pin = torch.cuda.is_available() if pin is None else pin
        if pin and not torch.cuda.is_available():
            raise HostPoolError("pin=True registers the pool with CUDA, and CUDA is not available here")

        def fill(mm: mmap.mmap) -> FillStats:
            return _fill(rad, keys, mm, row_bytes, depth, verify, faults)

        if not keys:
            return cls(keys, None, row_bytes, dtype, elems, pinned=False, path=None, filled_here=False, fill=None)
        if ram_dir is None:
            try:
                mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            except OSError as e:
                raise HostPoolError(f"cannot allocate the host pool ({size / MiB:.2f} MiB): {e.strerror}; "
                                    f"lower --host-pool-mib") from None
            stats, path, filled_here = fill(mm), None, True
        else:
            checksum = model_checksum(rad.path)
            layout = xxhash.xxh3_64_intdigest(msgspec.msgpack.encode([checksum, row_bytes, keys]))
            mm, path, stats = _open_shared(Path(ram_dir), f"{Path(rad.path).stem}.{layout:016x}.experts", size,
                                           _Ready(1, checksum, layout, size, 0), fill)
            filled_here = stats is not None
        pool = cls(keys, mm, row_bytes, dtype, elems, pinned=False, path=path, filled_here=filled_here, fill=stats)
        if pin:
            pool._pin()
        return pool

    # -- reading -----------------------------------------------------------------

    def row_index(self, layer: int, expert: int) -> int:
        """The row of (layer, expert); KeyError if the pool does not hold it."""
        return self._rows[(layer, expert)]

    def row(self, layer: int, expert: int) -> torch.Tensor:
        """[elems] view of the expert's row: gate [I, H] | up [I, H] | down [H, I] (compact: the extent's
        bytes, then up to the widest extent what the 4 KiB read brought along: never read as weights)."""
        return self.tensor[self._rows[(layer, expert)], :self.elems]

    def buffer(self, row: int) -> memoryview:
        """Row `row`'s bytes as a writable, 4 KiB-aligned memoryview (for O_DIRECT reads)."""
        return memoryview(self._mm)[row * self.row_bytes:(row + 1) * self.row_bytes]

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return len(self.keys) * self.row_bytes

    def line(self) -> str:
        """The start-up log line."""
        where = f"tmpfs file {self.path}" if self.path else "anonymous memory"
        pinned = "pinned" if self.pinned else "not pinned (no CUDA)"
        if not self.keys:
            return "host pool: empty"
        if self.fill is None:
            return (f"host pool: {len(self)} experts ({self.nbytes / MiB:.2f} MiB) in {where}, {pinned}; "
                    f"filled by another process, mapped as is")
        return (f"host pool: {len(self)} experts ({self.nbytes / MiB:.2f} MiB) in {where}, {pinned}; filled with "
                f"O_DIRECT in {self.fill.seconds:.2f} s ({self.fill.mb_per_s:.0f} MB/s), checksums verified")

    def close(self) -> None:
        """Unregister from CUDA; the memory goes when the last view of it does."""
        if self._unpin is not None:
            self._unpin()
            self._unpin, self.pinned = None, False

    # -- internals ---------------------------------------------------------------

    def _pin(self) -> None:
        try:
            self._unpin = register_pinned(self, self._bytes, self._mm)  # [rows, row_bytes]: all of the pool
        except PinError as e:
            raise HostPoolError(f"cudaHostRegister of the host pool ({self.nbytes / MiB:.2f} MiB) failed: {e}; "
                                f"raise the locked-memory limit (LimitMEMLOCK=infinity, ulimit -l) or lower "
                                f"--host-pool-mib") from None
        self.pinned = True


def _row_type(rad, keys: tuple[Key, ...]) -> tuple[torch.dtype, int]:
    """(the rows' dtype, the bytes of the widest extent): uint8 when any extent is compact (extents
    of several formats and sizes may share the pool), else the one dtype and size of them all."""
    entries = [rad.expert_entry(*k) for k in keys]
    if any(is_compact(e.dtype) for e in entries):
        return torch.uint8, max(e.nbytes for e in entries)
    dtype_name = entries[0].dtype if entries else "f32"
    nbytes = entries[0].nbytes if entries else 0
    for e in entries:
        if (e.dtype, e.nbytes) != (dtype_name, nbytes):
            raise HostPoolError(f"{rad.path}: expert (layer {e.layer}, expert {e.expert}) is {e.nbytes} bytes "
                                f"of {e.dtype}, others {nbytes} bytes of {dtype_name}: one pool holds one shape")
    return DTYPES[dtype_name], nbytes


def _fill(rad, keys: tuple[Key, ...], mm: mmap.mmap, row_bytes: int, depth: int, verify: bool,
          faults: Faults | None) -> FillStats:
    """Read every expert into its row with O_DIRECT; raise HostPoolError naming the first bad ones."""
    view = memoryview(mm)
    t0 = time.perf_counter()
    try:
        with DiskReader.from_rad(rad, depth=depth, verify=verify, faults=faults) as reader:
            results = reader.read_experts(keys, [view[i * row_bytes:(i + 1) * row_bytes] for i in range(len(keys))])
    except DiskError as e:
        raise HostPoolError(f"cannot fill the host pool: {e}") from None
    finally:
        view.release()
    seconds = time.perf_counter() - t0
    bad = [r.error for r in results if not r.ok]
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise HostPoolError("cannot fill the host pool: " + "; ".join(bad[:3]) + more)
    return FillStats(len(keys), sum(rad.expert_entry(*k).nbytes for k in keys), seconds)


def _open_shared(folder: Path, name: str, size: int, ready: _Ready, fill) -> tuple[mmap.mmap, Path, FillStats | None]:
    """Map folder/name (size bytes) MAP_SHARED, filling it first unless a matching ready marker says
    another process has. Returns (mapping, path, fill stats or None when it was already filled)."""
    why = tmpfs_refusal(folder)
    if why is not None:
        raise HostPoolError(why)
    path, marker, lock = folder / name, folder / (name + ".ready"), folder / (name + ".lock")
    lock_fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)  # released when lock_fd closes; the filler holds it throughout
        fd = _open_ready(path, marker, ready)
        if fd is not None:
            with os.fdopen(fd, "r+b") as f:
                return mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED), path, None
        # not filled: start a new file (a process still mapping an old one keeps its own inode)
        marker.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "r+b") as f:
            _allocate(f.fileno(), folder, path, size)
            mm = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED)
            try:
                stats = fill(mm)
            except BaseException:
                path.unlink(missing_ok=True)  # no marker: the next start fills a new file
                try:
                    mm.close()
                except BufferError:  # a view still exported; the mapping goes with it
                    pass
                raise
            tmp = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
            tmp.write_bytes(msgspec.json.encode(msgspec.structs.replace(ready, inode=os.fstat(f.fileno()).st_ino)))
            os.replace(tmp, marker)
            return mm, path, stats
    finally:
        os.close(lock_fd)


def _open_ready(path: Path, marker: Path, want: _Ready) -> int | None:
    """An fd of the pool file if the marker says it is filled for this model and layout, else None."""
    try:
        have = msgspec.json.decode(marker.read_bytes(), type=_Ready)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except (OSError, msgspec.DecodeError):
        return None
    st = os.fstat(fd)
    if msgspec.structs.replace(have, inode=0) == want and have.inode == st.st_ino and st.st_size == want.size:
        return fd
    os.close(fd)
    return None


def _allocate(fd: int, folder: Path, path: Path, size: int) -> None:
    """Reserve every page of the file now (posix_fallocate), so a full tmpfs fails here, not with SIGBUS."""
    vfs = os.statvfs(folder)
    free = vfs.f_bavail * vfs.f_frsize
    advice = "grow the tmpfs (mount -o remount,size=...), free space in it, or lower --host-pool-mib"
    if size > free:
        path.unlink(missing_ok=True)
        raise HostPoolError(f"ram={folder}: the tmpfs has {free / MiB:.2f} MiB free but the host expert pool needs "
                            f"{size / MiB:.2f} MiB; {advice}")
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        path.unlink(missing_ok=True)
        raise HostPoolError(f"ram={folder}: cannot reserve {size / MiB:.2f} MiB for the host expert pool: "
                            f"{e.strerror}; {advice}") from None
