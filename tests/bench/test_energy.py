"""Energy from NVML's counter, with a stand-in NVML; "not measured" without a GPU."""

from __future__ import annotations

import time
from types import SimpleNamespace

from radianced.bench.energy import MIN_UPDATES, EnergyMeter, update_interval


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
    meter = EnergyMeter(FakeNvml(), [0, 1], update_s=0.01)
    meter.start()
    time.sleep(0.25)
    r = meter.stop()
    assert r.joules == 2.0 and r.gpus == 2 and meter.device_name() == "2 x NVIDIA H200"
    assert r.resolved and r.mean_w == 2.0 / r.seconds and r.update_s == 0.01
    assert r.samples and all((p.power_w, p.util_pct, p.memory_mib) == (300.0, 50.0, 2048.0) for p in r.samples)


def test_without_nvml_or_a_gpu_there_is_no_meter(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # the import fails as with no nvidia-ml-py
    assert EnergyMeter.open() is None


class SteppedNvml(FakeNvml):
    """An energy counter the driver updates every `every_s` seconds (as an H200's, about every 100 ms)."""

    def __init__(self, every_s: float):
        super().__init__()
        self.every_s, self.t0 = every_s, time.perf_counter()

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        return 5_000 + 7_000 * int((time.perf_counter() - self.t0) / self.every_s)


def test_the_counters_update_interval_is_measured():
    assert 0.015 <= update_interval(SteppedNvml(0.02), 0) <= 0.03  # the median gap: one late poll moves it little
    assert update_interval(SteppedNvml(10.0), 0, probe_s=0.05) == 0.05  # no change seen: the probe is the bound


def test_a_reading_shorter_than_the_counters_updates_is_not_resolved():
    meter = EnergyMeter(SteppedNvml(0.02), [0], update_s=0.02)
    meter.start()
    time.sleep(0.05)  # 2.5 updates: the difference is 2 or 3 steps, an error of up to 50%
    r = meter.stop()
    assert r.seconds < MIN_UPDATES * 0.02 and not r.resolved and r.mean_w is None
