"""Expert extents read from the model file with io_uring and O_DIRECT (the disk tier).

`DiskReader.read_experts(keys, into)` reads each routed expert's extent (one
aligned extent per expert, see `model/rad_format.py`) into caller memory with several
reads in flight, checks each extent's xxh3_64 as it lands, and returns one
`ReadResult` per expert. A short read, an I/O error or a checksum mismatch fails
only that expert's result, with a message naming the file, the layer, the
expert and the offset; nothing raises for a bad extent.

How it waits (DESIGN.md "Threads and I/O"): `io_uring_wait_cqe` would hold the
GIL for the whole wait, so the ring reports completions to a registered
eventfd; the blocking call sleeps in `poll()` on that eventfd (the GIL is
released) and then peeks the completions. `read_experts_async` instead
registers the eventfd with the asyncio loop (`add_reader`), so the loop serves
other work while the reads run. Reads go through `prep_readv` into memoryviews
of aligned memory (aligned.py: `aligned_buffer`, a host pool's rows, pinned staging):
O_DIRECT refuses unaligned buffers, which rules out `prep_read`'s bytearrays.

Each read asks for the extent rounded up to ALIGN bytes (O_DIRECT reads whole
blocks), so a destination must hold that many bytes; the bytes past the extent
(padding, or the next extent's head) are not part of the result.

One batch at a time per reader: a second call while one runs raises
RuntimeError. Test hook: `Faults` (faults.py) fails or delays a chosen expert's read.

Needs python-liburing 2024.5.3 (the Cython build): the 2026 wheels on PyPI
contain AVX-512 instructions and die with SIGILL on CPUs without them.
"""

from __future__ import annotations

import asyncio
import errno as errnos
import os
import select
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import liburing
import xxhash

from radianced.tiers.aligned import ALIGN, align_up, check_buffer
from radianced.tiers.faults import Faults

DEPTH = 32  # reads in flight

# include/uapi/linux/io_uring.h (kernel ABI; liburing 2024.5.3 does not export them at top level)
IOSQE_IO_LINK = 1 << 2
IORING_TIMEOUT_ETIME_SUCCESS = 1 << 5  # an expired timeout does not break its link (Linux 5.16+)
_DELAY_TAG = 1 << 62  # user_data of a Faults.delay timeout

Key = tuple[int, int]  # (layer, expert)


class DiskError(RuntimeError):
    """The reader cannot start (file, ring or library); the message says what to do."""


@dataclass(frozen=True)
class Extent:
    offset: int  # a multiple of ALIGN
    nbytes: int
    checksum: int | None  # xxh3_64 of the nbytes; None: not checked


@dataclass(frozen=True)
class ReadResult:
    """One expert's read: `error` is None when its bytes are in the destination and verified."""

    key: Key
    offset: int
    nbytes: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class _Job:
    index: int
    key: Key | None
    offset: int
    buf: memoryview  # exactly the bytes the read asks for (a multiple of ALIGN)
    nbytes: int  # bytes that must arrive
    checksum: int | None


class _Ring:
    """An io_uring whose completions signal an eventfd; readv submissions tagged by user_data."""

    def __init__(self, depth: int):
        if not hasattr(liburing, "io_uring"):
            raise DiskError(f"python-liburing {getattr(liburing, '__version__', '?')} is installed; radianced "
                            f"needs liburing==2024.5.3 (the 2026 wheels use AVX-512 instructions and crash on "
                            f"CPUs without them): pip install liburing==2024.5.3")
        self.ring = liburing.io_uring()
        self.cqe = liburing.io_uring_cqe()
        # each read may take two entries (a Faults.delay timeout linked before it)
        ret = liburing.io_uring_queue_init(2 * depth, self.ring, 0)
        if ret < 0:
            raise DiskError(f"io_uring_queue_init failed: {os.strerror(-ret)} (is io_uring disabled by "
                            f"sysctl kernel.io_uring_disabled or a seccomp profile?)")
        self.efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        ret = liburing.io_uring_register_eventfd(self.ring, self.efd)
        if ret < 0:
            self.close()
            raise DiskError(f"io_uring_register_eventfd failed: {os.strerror(-ret)}")
        self._poll = select.poll()
        self._poll.register(self.efd, select.POLLIN)
        self._iovecs: dict[int, object] = {}  # tag -> iovec, alive until its completion
        self._timespecs: dict[int, object] = {}

    def prep_read(self, fd: int, tag: int, offset: int, buf: memoryview, delay: float = 0.0) -> None:
        if delay > 0:
            ts = liburing.timespec(delay)
            sqe = liburing.io_uring_get_sqe(self.ring)
            liburing.io_uring_prep_timeout(sqe, ts, 0, IORING_TIMEOUT_ETIME_SUCCESS)
            liburing.io_uring_sqe_set_flags(sqe, IOSQE_IO_LINK)
            sqe.user_data = _DELAY_TAG | tag
            self._timespecs[tag] = ts
        iov = liburing.iovec(buf)
        sqe = liburing.io_uring_get_sqe(self.ring)
        liburing.io_uring_prep_readv(sqe, fd, iov, offset)
        sqe.user_data = tag
        self._iovecs[tag] = iov

    def submit(self) -> None:
        ret = liburing.io_uring_submit(self.ring)
        if ret < 0:
            raise DiskError(f"io_uring_submit failed: {os.strerror(-ret)}")

    def wait(self) -> None:
        """Sleep until a completion is signalled (poll releases the GIL), then reset the eventfd."""
        self._poll.poll()
        self.clear()

    def clear(self) -> None:
        try:
            os.eventfd_read(self.efd)
        except BlockingIOError:
            pass

    def reap(self) -> list[tuple[int, int]]:
        """Every completion posted so far, as (tag, res); delay timeouts are dropped."""
        out = []
        while liburing.io_uring_peek_cqe(self.ring, self.cqe) == 0:
            tag, res = self.cqe.user_data, self.cqe.res
            liburing.io_uring_cqe_seen(self.ring, self.cqe)
            if tag & _DELAY_TAG:
                self._timespecs.pop(tag & ~_DELAY_TAG, None)
                continue
            self._iovecs.pop(tag, None)
            out.append((tag, res))
        return out

    def close(self) -> None:
        if self.ring is not None:
            liburing.io_uring_queue_exit(self.ring)
            self.ring = None
            os.close(self.efd)


class _Batch:
    """One call's reads: submitted up to `depth` at a time, finished as they complete."""

    def __init__(self, jobs: list[_Job], on_done: Callable[[int, object], None] | None):
        self.jobs = jobs
        self.next = 0
        self.in_flight = 0
        self.results: list[object] = [None] * len(jobs)
        self.on_done = on_done
        self.stopped = False  # no further submissions (cancelled, or on_done raised)
        self.exc: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.in_flight == 0 and (self.stopped or self.next == len(self.jobs))


class DiskReader:
    """Reads expert extents of one file with O_DIRECT through one io_uring.

    extents: (layer, expert) -> Extent (offset, nbytes, xxh3_64). Use
    `from_rad` for a `.rad`. Owns an fd, a ring and an eventfd: `close()` them
    (or use it as a context manager). Raises DiskError when the file cannot be
    opened for O_DIRECT or the ring cannot be set up.
    """

    def __init__(self, path: str | os.PathLike, extents: Mapping[Key, Extent], *, depth: int = DEPTH,
                 verify: bool = True, faults: Faults | None = None):
        self.path = Path(path)
        self.extents = extents
        self.depth = depth
        self.verify = verify
        self.faults = faults
        self._busy = threading.Lock()
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as e:
            hint = " (its file system refuses O_DIRECT; move the model to a local disk)" \
                if e.errno == errnos.EINVAL else ""
            raise DiskError(f"{self.path}: cannot open for O_DIRECT reads: {e.strerror}{hint}") from None
        try:
            self._ring = _Ring(depth)
        except BaseException:
            os.close(self.fd)
            raise

    @classmethod
    def from_rad(cls, rad, path: str | os.PathLike | None = None, **kw) -> DiskReader:
        """A reader of an open `RadFile`'s routed experts (`path`: another copy of the same file)."""
        extents = {(e.layer, e.expert): Extent(e.offset, e.nbytes, e.checksum) for e in rad.header.experts}
        return cls(path or rad.path, extents, **kw)

    def read_size(self, layer: int, expert: int) -> int:
        """Bytes a destination for this expert must hold: its extent rounded up to ALIGN."""
        return align_up(self._extent((layer, expert)).nbytes)

    # -- reading -----------------------------------------------------------------

    def read_experts(self, keys: Sequence[Key], into: Sequence[memoryview],
                     on_done: Callable[[int, ReadResult], None] | None = None) -> list[ReadResult]:
        """Read expert keys[i] into into[i]; blocks the calling thread (not the GIL) until all are in.

        on_done(i, result) runs as each read completes and is checked (e.g. to
        start copying it to the device). Raises ValueError for an unknown
        expert or a destination that is unaligned, read-only or too small
        (before any read starts); a bad extent only fails its ReadResult.
        """
        return self._run(self._expert_jobs(keys, into), on_done)

    async def read_experts_async(self, keys: Sequence[Key], into: Sequence[memoryview],
                                 on_done: Callable[[int, ReadResult], None] | None = None) -> list[ReadResult]:
        """`read_experts` on the running loop: completions arrive through `loop.add_reader`.

        If the awaiting task is cancelled, reads not yet issued are dropped and
        the call waits for those in flight (they write into `into`) before
        raising CancelledError.
        """
        return await self._run_async(self._expert_jobs(keys, into), on_done)

    def read_ranges(self, ranges: Sequence[tuple[int, memoryview]]) -> list[int]:
        """Raw reads of (offset, buffer): bytes read each, or -errno. No checksum (the disk probe)."""
        jobs = []
        for i, (offset, buf) in enumerate(ranges):
            buf = check_buffer(buf, len(buf), f"range {i}")
            if offset % ALIGN or len(buf) % ALIGN:
                raise ValueError(f"range {i}: offset {offset} and length {len(buf)} must be multiples of {ALIGN}")
            jobs.append(_Job(i, None, offset, buf, len(buf), None))
        return self._run(jobs, None)

    def close(self) -> None:
        if self._ring is not None:
            self._ring.close()
            self._ring = None
            os.close(self.fd)

    def __enter__(self) -> DiskReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the engine --------------------------------------------------------------

    def _extent(self, key: Key) -> Extent:
        e = self.extents.get(tuple(key))
        if e is None:
            raise ValueError(f"{self.path}: no routed expert (layer {key[0]}, expert {key[1]}) in this file")
        return e

    def _expert_jobs(self, keys: Sequence[Key], into: Sequence[memoryview]) -> list[_Job]:
        if len(keys) != len(into):
            raise ValueError(f"{len(keys)} experts but {len(into)} destinations")
        jobs = []
        for i, (key, buf) in enumerate(zip(keys, into)):
            key = (int(key[0]), int(key[1]))
            e = self._extent(key)
            size = align_up(e.nbytes)
            buf = check_buffer(buf, size, f"destination of expert (layer {key[0]}, expert {key[1]})")
            jobs.append(_Job(i, key, e.offset, buf[:size], e.nbytes, e.checksum if self.verify else None))
        return jobs

    def _run(self, jobs: list[_Job], on_done) -> list:
        if self._ring is None:
            raise RuntimeError(f"{self.path}: the reader is closed")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(f"{self.path}: the reader is already running a batch (one at a time)")
        try:
            batch = _Batch(jobs, on_done)
            self._submit(batch)
            while not batch.done:
                self._ring.wait()
                self._complete(batch)
            if batch.exc is not None:
                raise batch.exc
            return batch.results
        finally:
            self._busy.release()

    async def _run_async(self, jobs: list[_Job], on_done) -> list:
        if self._ring is None:
            raise RuntimeError(f"{self.path}: the reader is closed")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(f"{self.path}: the reader is already running a batch (one at a time)")
        loop = asyncio.get_running_loop()
        batch = _Batch(jobs, on_done)
        finished = loop.create_future()

        def on_readable() -> None:
            self._ring.clear()
            self._complete(batch)
            if batch.done and not finished.done():
                finished.set_result(None)

        loop.add_reader(self._ring.efd, on_readable)
        try:
            self._submit(batch)
            if batch.done:
                finished.set_result(None)
            try:
                await asyncio.shield(finished)
            except asyncio.CancelledError:
                batch.stopped = True  # issue nothing more; what is in flight still lands in `into`
                if not batch.done:
                    await finished
                raise
        finally:
            loop.remove_reader(self._ring.efd)
            self._busy.release()
        if batch.exc is not None:
            raise batch.exc
        return batch.results

    def _submit(self, batch: _Batch) -> None:
        n = 0
        while not batch.stopped and batch.next < len(batch.jobs) and batch.in_flight < self.depth:
            job = batch.jobs[batch.next]
            delay = self.faults.delays.pop(job.key, 0.0) if self.faults and job.key else 0.0
            self._ring.prep_read(self.fd, job.index + 1, job.offset, job.buf, delay)
            batch.next += 1
            batch.in_flight += 1
            n += 1
        if n:
            self._ring.submit()

    def _complete(self, batch: _Batch) -> None:
        for tag, res in self._ring.reap():
            job = batch.jobs[tag - 1]
            batch.in_flight -= 1
            if self.faults and job.key in self.faults.failures:
                res = -self.faults.failures.pop(job.key)
            if job.key is None:
                batch.results[job.index] = res
                continue
            result = ReadResult(job.key, job.offset, job.nbytes, self._check(job, res))
            batch.results[job.index] = result
            if batch.on_done is not None and batch.exc is None:
                try:
                    batch.on_done(job.index, result)
                except BaseException as e:  # stop issuing; raise once the reads in flight are in
                    batch.exc, batch.stopped = e, True
        self._submit(batch)

    def _check(self, job: _Job, res: int) -> str | None:
        where = f"{self.path}: expert (layer {job.key[0]}, expert {job.key[1]}) at offset {job.offset}"
        if res < 0:
            name = errnos.errorcode.get(-res, str(-res))
            return f"{where}: read failed: {os.strerror(-res)} ({name})"
        if res < job.nbytes:
            try:
                size = os.fstat(self.fd).st_size
            except OSError:
                size = -1
            return (f"{where}: short read, {res} of {job.nbytes} bytes (the file is {size} bytes; "
                    f"is it truncated? Copy it again or re-run radiancectl convert)")
        if job.checksum is not None:
            actual = xxhash.xxh3_64_intdigest(job.buf[:job.nbytes])
            if actual != job.checksum:
                return (f"{where}: checksum mismatch (read {actual:016x}, header says {job.checksum:016x}); "
                        f"the file is corrupt: copy it again or re-run radiancectl convert")
        return None
