"""Energy from NVML's counter, with a stand-in NVML; "not measured" without a GPU."""

from __future__ import annotations

import time
from types import SimpleNamespace

from radianced.bench.energy import EnergyMeter


class FakeNvml:
    """Two GPUs whose energy counters advance 1000 mJ per read."""

    def __init__(self):
        self.mj = {0: 5_000, 1: 9_000}

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        self.mj[h] += 1000
        return self.mj[h]

    def nvmlDeviceGetPowerUsage(self, h):
        return 150_000  # mW

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=40 + 20 * h)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=2**30)

    def nvmlDeviceGetName(self, h):
        return "NVIDIA H200"


def test_energy_is_the_counter_difference_summed_over_gpus():
    meter = EnergyMeter(FakeNvml(), [0, 1])
    meter.start()
    time.sleep(0.25)
    r = meter.stop()
    assert r.joules == 2.0 and r.gpus == 2 and meter.device_name() == "2 x NVIDIA H200"
    assert r.samples and all((p.power_w, p.util_pct, p.memory_mib) == (300.0, 50.0, 2048.0) for p in r.samples)


def test_without_nvml_or_a_gpu_there_is_no_meter(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # the import fails as with no nvidia-ml-py
    assert EnergyMeter.open() is None
