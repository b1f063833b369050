"""Start-up probes: the host -> device link (a memcpy on the CPU) and O_DIRECT reads of the model file."""

from __future__ import annotations

import re

import pytest
import torch

from radianced.tiers.link import DiskProbe, LinkProbe, probe_disk, probe_pcie

MiB = 1 << 20


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in")
def test_without_a_gpu_the_probe_times_a_memcpy_and_says_cpu():
    p = probe_pcie(nbytes=8 * MiB)
    assert p.cpu and p.device == "cpu" and p.trials == 4 and p.nbytes == 8 * MiB
    assert 0.05 < p.gb_per_s < 1000
    assert re.fullmatch(r"PCIe probe: cpu: no GPU, \d+\.\d GB/s host memcpy instead \(best of 4\)", p.line())


def test_the_gpu_line_has_the_start_up_format():
    assert LinkProbe(53.84, "cuda:0 (NVIDIA H200)", 256 * MiB, 4).line() == \
        "PCIe probe: 53.8 GB/s host -> device (best of 4)"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gpu_probe_copies_pinned_memory_to_the_card():
    p = probe_pcie(nbytes=64 * MiB)
    assert not p.cpu and p.device.startswith("cuda") and p.gb_per_s > 1


def test_the_disk_probe_reads_the_model_file_with_o_direct(tier_rad):
    size = tier_rad.stat().st_size
    p = probe_disk(tier_rad, nbytes=256 * MiB, chunk=64 * 1024, depth=4)
    assert p.nbytes == size // (64 * 1024) * (64 * 1024) and p.chunk == 64 * 1024 and p.depth == 4
    assert p.gb_per_s > 0
    assert re.fullmatch(r"disk probe: \d+\.\d\d GB/s O_DIRECT read of m\.rad \(first [\d.]+ MiB, "
                        r"4 reads of 0\.0625 MiB in flight\)", p.line())
    assert DiskProbe(1.02, tier_rad, 256 * MiB, 4 * MiB, 8).line() == \
        "disk probe: 1.02 GB/s O_DIRECT read of m.rad (first 256 MiB, 8 reads of 4 MiB in flight)"
