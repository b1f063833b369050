"""Start-up probes of the two links experts travel: host -> device, and disk -> host.

`probe_pcie()` times copies of pinned host memory to the card and keeps the
best of 4 (the figure overflow reads are measured against); on the CPU backend
there is no link, so it times a host memcpy and says "cpu". `probe_disk(path)`
times O_DIRECT reads of the model file's first MiBs through the disk tier's
io_uring reader (the figure disk-tier reads are measured against). Both return
numbers and the start-up log line.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from radianced.tiers.aligned import ALIGN, aligned_buffer
from radianced.tiers.disk import DiskReader

MiB = 1 << 20
TRIALS = 4


@dataclass(frozen=True)
class LinkProbe:
    gb_per_s: float  # 1e9 bytes per second, best trial
    device: str  # "cuda:0 (NVIDIA H200)" or "cpu"
    nbytes: int  # bytes per trial
    trials: int

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"

    def line(self) -> str:
        if self.cpu:
            return (f"PCIe probe: cpu: no GPU, {self.gb_per_s:.1f} GB/s host memcpy instead "
                    f"(best of {self.trials})")
        return f"PCIe probe: {self.gb_per_s:.1f} GB/s host -> device (best of {self.trials})"


@dataclass(frozen=True)
class DiskProbe:
    gb_per_s: float
    path: Path
    nbytes: int  # bytes read
    chunk: int  # bytes per read
    depth: int  # reads in flight

    def line(self) -> str:
        return (f"disk probe: {self.gb_per_s:.2f} GB/s O_DIRECT read of {self.path.name} (first "
                f"{self.nbytes / MiB:g} MiB, {self.depth} reads of {self.chunk / MiB:g} MiB in flight)")


def probe_pcie(device: torch.device | str | None = None, nbytes: int = 256 * MiB, trials: int = TRIALS) -> LinkProbe:
    """Best of `trials` copies of `nbytes` from pinned host memory to `device` (default: cuda:0 if any).

    Each trial is timed with CUDA events around one non-blocking copy, after a
    warm-up copy. Without CUDA, times `trials` host-to-host copies instead.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        src = torch.ones(nbytes, dtype=torch.uint8)  # touched, so no page faults are timed
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        best = 0.0
        for _ in range(trials):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = max(best, nbytes / (time.perf_counter() - t0))
        return LinkProbe(best / 1e9, "cpu", nbytes, trials)
    src = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)  # warm-up: first-touch mapping, clocks
    torch.cuda.synchronize(device)
    best = 0.0
    with torch.cuda.device(device):
        for _ in range(trials):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()  # deliberate host sync: this is a measurement
            best = max(best, nbytes / (start.elapsed_time(end) / 1e3))
    name = torch.cuda.get_device_name(device)
    return LinkProbe(best / 1e9, f"{device} ({name})", nbytes, trials)


def probe_disk(path: str | os.PathLike, nbytes: int = 512 * MiB, chunk: int = 8 * MiB, depth: int = 32) -> DiskProbe:
    """O_DIRECT read rate of `path`'s first `nbytes` (fewer if the file is smaller), `depth` reads in flight.

    The reads bypass the page cache, so a file read moments ago is not measured
    from RAM. The bytes are discarded: reads share `depth` buffers. The defaults
    were the fastest of four shapes on the H200 host's disk (8 x 4, 32 x 4,
    32 x 8 and 16 x 16 MiB in flight: 1.42, 1.23, 1.59, 1.49 GB/s).
    """
    path = Path(path)
    size = os.stat(path).st_size // ALIGN * ALIGN
    chunk = max(ALIGN, min(chunk, size) // ALIGN * ALIGN)
    total = max(chunk, min(nbytes, size) // chunk * chunk)
    bufs = [aligned_buffer(chunk) for _ in range(depth)]
    ranges = [(off, bufs[i % depth]) for i, off in enumerate(range(0, total, chunk))]
    with DiskReader(path, {}, depth=depth) as reader:
        t0 = time.perf_counter()
        got = reader.read_ranges(ranges)
        seconds = time.perf_counter() - t0
    bad = [(off, r) for (off, _), r in zip(ranges, got) if r != chunk]
    if bad:
        off, r = bad[0]
        what = os.strerror(-r) if r < 0 else f"{r} of {chunk} bytes"
        raise OSError(f"{path}: disk probe read at offset {off} failed: {what}")
    return DiskProbe(total / seconds / 1e9, path, total, chunk, depth)
