"""One workload's outcome: its samples, what the daemon counted meanwhile, its energy, its own checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radianced.bench.client import Sample
from radianced.bench.energy import EnergyReading
from radianced.bench.scrape import ServerDelta
from radianced.bench.stats import Distribution, Summary, summarize


@dataclass(frozen=True)
class WorkloadResult:
    """A row of the report."""

    name: str  # unique in the run: "decode", "prefill 4096", "sweep c=4", "overload", ...
    kind: str  # decode | prefill | sweep | overload | multi-turn | stability | quality
    concurrency: int  # requests in flight at most
    samples: tuple[Sample, ...]  # every request, in the order they were sent
    server: ServerDelta  # /metrics after minus before
    energy: EnergyReading | None  # None: not measured (no NVIDIA GPU with an energy counter)
    notes: dict[str, Any] = field(default_factory=dict)  # the workload's own findings (429s, prefix reuse, ...)
    client_lag: Distribution | None = None  # the client's own loop lag meanwhile (bench/loop_lag.py); None: not read

    @property
    def summary(self) -> Summary:
        return summarize(self.samples)

    @property
    def joules_per_token(self) -> float | None:
        tokens = self.summary.output_tokens
        return self.energy.joules / tokens if self.energy is not None and self.energy.resolved and tokens else None
