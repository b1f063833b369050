"""A workload's samples -> its numbers: throughput, and TTFT, TPOT, ITL and end-to-end percentiles.

The definitions are `vllm bench serve`'s, so rows can be set beside its output:
output throughput is the output tokens of successful requests over the
workload's wall time (first send to last answer); TPOT is per request,
(e2e - TTFT) / (tokens - 1), over requests with two tokens or more; ITL pools
every gap between token-carrying chunks of every request. Percentiles
interpolate linearly between closest ranks (numpy's default method).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from radianced.bench.client import Sample

PERCENTILES = (50, 95, 99)


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency in seconds; all None when there is no value."""

    count: int  # values summarized
    mean: float | None
    p50: float | None
    p95: float | None
    p99: float | None
    max: float | None

    @staticmethod
    def of(values: Sequence[float]) -> Distribution:
        if not values:
            return Distribution(0, None, None, None, None, None)
        a = np.asarray(values, dtype=np.float64)
        p50, p95, p99 = (float(x) for x in np.percentile(a, PERCENTILES))
        return Distribution(len(a), float(a.mean()), p50, p95, p99, float(a.max()))


@dataclass(frozen=True)
class Summary:
    """The numbers of one workload's samples."""

    requests: int  # requests sent
    ok: int  # 200, a complete stream, no error
    status_counts: dict[int, int]  # HTTP status -> requests (0: no response)
    cut_short: int  # 200s whose stream ended early, carried an error, or lost tokens
    output_tokens: int  # tokens received by the successful requests
    prompt_tokens: int  # usage prompt tokens of the successful requests
    duration_s: float  # first send to the last answer
    output_tok_s: float | None  # output_tokens / duration_s
    request_s: float | None  # successful requests per second
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution


def summarize(samples: Sequence[Sample]) -> Summary:
    """The workload's numbers. Latencies come from successful requests only."""
    ok = [s for s in samples if s.ok]
    statuses: dict[int, int] = {}
    for s in samples:
        statuses[s.status] = statuses.get(s.status, 0) + 1
    duration = _duration(samples)
    out_tokens = sum(s.tokens_received for s in ok)
    return Summary(
        requests=len(samples), ok=len(ok), status_counts=dict(sorted(statuses.items())),
        cut_short=sum(s.cut_short for s in samples), output_tokens=out_tokens,
        prompt_tokens=sum(s.prompt_tokens or 0 for s in ok), duration_s=duration,
        output_tok_s=out_tokens / duration if duration > 0 else None,
        request_s=len(ok) / duration if duration > 0 else None,
        ttft=Distribution.of([s.ttft_s for s in ok if s.ttft_s is not None]),
        tpot=Distribution.of([s.tpot_s for s in ok if s.tpot_s is not None]),
        itl=Distribution.of([gap for s in ok for gap in s.itl_s]),
        e2e=Distribution.of([s.e2e_s for s in ok if s.e2e_s is not None]),
    )


def _duration(samples: Sequence[Sample]) -> float:
    """First send to the last answer, in seconds (0 with no answer)."""
    ends = [s.sent_at + s.e2e_s for s in samples if s.e2e_s is not None]
    if not ends:
        return 0.0
    return max(ends) - min(s.sent_at for s in samples)


def slope_per_minute(times_s: Sequence[float], values: Sequence[float]) -> float | None:
    """Least-squares slope of `values` against time, per minute (None with fewer than two points)."""
    if len(times_s) < 2 or max(times_s) == min(times_s):
        return None
    return float(np.polyfit(np.asarray(times_s) / 60.0, np.asarray(values, dtype=np.float64), 1)[0])
