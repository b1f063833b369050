"""GPU energy around a workload, from NVML; "not measured" anywhere else.

`nvmlDeviceGetTotalEnergyConsumption` is a counter of millijoules since the
driver loaded (Volta and newer), so the energy of a workload is the difference
of two reads, summed over the GPUs. The driver updates the counter only every so
often (about every 100 ms on an H200, measured when the meter opens), so a read
is off by up to one update's energy: a workload shorter than `MIN_UPDATES`
updates is reported "too short" rather than with an error over 10%. A thread also samples
power and GPU utilization every `SAMPLE_S` for the power-against-utilization
plot and the memory slope of the stability pass. Without nvidia-ml-py, a
driver, or a GPU that reports energy, `EnergyMeter.open()` returns None and
the report says "not measured": never an estimate.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

SAMPLE_S = 0.1
MIN_UPDATES = 20  # a reading spans at least this many counter updates: its error is at most 2 / 20
PROBE_S = 1.5  # the longest the meter watches the counter for its update interval


@dataclass(frozen=True)
class PowerSample:
    """One read of every GPU: seconds since the meter started, summed power, mean utilization, memory."""

    t_s: float
    power_w: float  # summed over the GPUs
    util_pct: float  # mean GPU utilization over the GPUs
    memory_mib: float  # device memory used, summed


@dataclass(frozen=True)
class EnergyReading:
    """A workload's energy on the GPUs."""

    joules: float  # energy counter difference, summed over the GPUs
    seconds: float  # wall time between the two reads
    gpus: int
    samples: tuple[PowerSample, ...]  # the sampler's reads in between
    update_s: float  # how often the driver updates the counter (measured when the meter opened)

    @property
    def resolved(self) -> bool:
        """The reading spans at least MIN_UPDATES updates of the counter (else its error could pass 10%)."""
        return self.seconds >= MIN_UPDATES * self.update_s

    @property
    def mean_w(self) -> float | None:
        return self.joules / self.seconds if self.resolved and self.seconds > 0 else None


class EnergyMeter:
    """NVML energy counters of every visible GPU. `start()` then `stop()` around each workload."""

    def __init__(self, nvml, handles, update_s: float):
        self._nvml = nvml
        self._handles = handles
        self.update_s = update_s
        self._t0 = 0.0
        self._mj0: list[int] = []
        self._samples: list[PowerSample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def open() -> EnergyMeter | None:
        """A meter over every GPU, or None where NVML or an energy counter is missing."""
        try:
            import pynvml as nvml

            nvml.nvmlInit()
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            for h in handles:
                nvml.nvmlDeviceGetTotalEnergyConsumption(h)  # raises on GPUs without the counter
        except Exception:  # no package, no driver, no counter: all mean "not measured"
            return None
        return EnergyMeter(nvml, handles, update_interval(nvml, handles[0])) if handles else None

    def device_name(self) -> str:
        names = [self._nvml.nvmlDeviceGetName(h) for h in self._handles]
        return f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)

    def start(self) -> None:
        self._samples = []
        self._stop.clear()
        self._t0 = time.perf_counter()
        self._mj0 = self._energy_mj()
        self._thread = threading.Thread(target=self._sample_loop, name="bench-nvml", daemon=True)
        self._thread.start()

    def stop(self) -> EnergyReading:
        mj = self._energy_mj()
        seconds = time.perf_counter() - self._t0
        self._stop.set()
        self._thread.join()
        joules = sum(b - a for a, b in zip(self._mj0, mj)) / 1000.0
        return EnergyReading(joules, seconds, len(self._handles), tuple(self._samples), self.update_s)

    def _energy_mj(self) -> list[int]:
        return [self._nvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self._handles]

    def _sample_loop(self) -> None:
        n = self._nvml
        while not self._stop.wait(SAMPLE_S):
            power = sum(n.nvmlDeviceGetPowerUsage(h) for h in self._handles) / 1000.0  # mW -> W
            util = sum(n.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles) / len(self._handles)
            mem = sum(n.nvmlDeviceGetMemoryInfo(h).used for h in self._handles) / 2**20
            self._samples.append(PowerSample(time.perf_counter() - self._t0, power, util, mem))


def update_interval(nvml, handle, probe_s: float = PROBE_S) -> float:
    """Seconds between the driver's updates of the energy counter: the median gap between the changes seen
    while polling it every millisecond (up to `probe_s`). Fewer than two changes seen: `probe_s`, a bound
    that leaves only readings of MIN_UPDATES x `probe_s` resolved."""
    changes, last, end = [], nvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.perf_counter() + probe_s
    while len(changes) < 5 and time.perf_counter() < end:
        time.sleep(0.001)
        mj = nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        if mj != last:
            changes.append(time.perf_counter())
            last = mj
    gaps = sorted(b - a for a, b in zip(changes, changes[1:]))
    return gaps[len(gaps) // 2] if gaps else probe_s
