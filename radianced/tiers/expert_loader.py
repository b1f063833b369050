"""Expert extents from the model file into slab rows: O_DIRECT reads into pinned staging, then copies.

`ExpertLoader.load(keys, rows)` puts expert keys[i] into row rows[i] of the
slab (a VRAM slot, or a row of the disk tier's two layer buffers): up to
`staging_rows` reads in flight through `DiskReader` (io_uring, O_DIRECT,
xxh3 checked as each lands), each copied into its row as soon as its read
completes (on CUDA an asynchronous copy from pinned memory, so the copy of one
expert overlaps the reads of the next). More keys than staging rows go in
rounds; a round waits for the previous round's copies before reusing staging.

A failed read (short read, I/O error, checksum mismatch) leaves its row
untouched and comes back as a `ReadResult` with the error; nothing raises for
a bad extent. The same loader fills the slots at start-up (pinned experts and
disk-homed pre-fill) and serves the disk tier's per-layer reads, so both go
around the page cache.

Counters: `bytes_read` (extent bytes that arrived and verified) and
`drain_latencies()`, seconds from a round's submission to each read's
completion (what a step waited for that expert).
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Sequence

import torch

from radianced.kernels.pinned import PinError, register_pinned
from radianced.tiers.aligned import align_up
from radianced.tiers.disk import DiskReader, ReadResult

Key = tuple[int, int]  # (layer, expert)

STAGING_ROWS = 16  # reads in flight per round (pinned host memory: 16 x the extent)


class ExpertLoader:
    def __init__(self, reader: DiskReader, slab: torch.Tensor, extent_bytes: int, staging_rows: int = STAGING_ROWS):
        """slab: [rows, width] (the arena's pages, reserved buffer rows included); extent_bytes:
        bytes of one expert (width * itemsize). Staging is pinned when the slab is on CUDA."""
        self.reader, self.slab, self.extent_bytes = reader, slab, extent_bytes
        self.row_bytes = align_up(extent_bytes)
        self.staging_rows = staging_rows
        self._mm = mmap.mmap(-1, staging_rows * self.row_bytes)  # page-aligned: O_DIRECT destinations
        self._staging = torch.frombuffer(self._mm, dtype=torch.uint8).view(staging_rows, self.row_bytes)
        self._cuda = slab.device.type == "cuda"
        self._unpin = None
        if self._cuda:
            try:
                self._unpin = register_pinned(self, self._staging, self._mm)
            except PinError as e:
                raise RuntimeError(f"cudaHostRegister of the expert read staging ({self._staging.numel()} B) "
                                   f"failed: {e}; raise the locked-memory limit (ulimit -l)") from None
        self._copied: torch.cuda.Event | None = None  # after the last round's copies (CUDA)
        self.bytes_read = 0
        self._latencies: list[float] = []

    def load(self, keys: Sequence[Key], rows: Sequence[int]) -> list[ReadResult]:
        """Read keys[i] into slab row rows[i]; one ReadResult per key, in order. Blocks the calling
        thread (not the GIL) until every read is in; on CUDA the copies are queued on the current stream."""
        if len(keys) != len(rows):
            raise ValueError(f"{len(keys)} experts for {len(rows)} rows")
        results: list[ReadResult] = []
        for start in range(0, len(keys), self.staging_rows):
            results += self._round(keys[start:start + self.staging_rows], rows[start:start + self.staging_rows])
        return results

    def drain_latencies(self) -> list[float]:
        """Seconds per expert read since the last call."""
        out, self._latencies = self._latencies, []
        return out

    def close(self) -> None:
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        self.reader.close()

    def _round(self, keys: Sequence[Key], rows: Sequence[int]) -> list[ReadResult]:
        if self._copied is not None:
            self._copied.synchronize()  # the previous round's copies have left the staging rows
        view = memoryview(self._mm)
        into = [view[i * self.row_bytes:(i + 1) * self.row_bytes] for i in range(len(keys))]
        t0 = time.perf_counter()

        def arrived(i: int, result: ReadResult) -> None:
            self._latencies.append(time.perf_counter() - t0)
            if result.ok:
                self.bytes_read += result.nbytes
                dst = self.slab[rows[i]].view(torch.uint8)
                dst.copy_(self._staging[i, :self.extent_bytes], non_blocking=self._cuda)

        try:
            results = self.reader.read_experts(list(keys), into, on_done=arrived)
        finally:
            for v in into:
                v.release()
            view.release()
        if self._cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return results

