"""Hand-built samples and rows for the bench's unit tests (exact numbers, no daemon)."""

from __future__ import annotations

from radianced.bench.client import Sample
from radianced.bench.result import WorkloadResult
from radianced.bench.scrape import ServerDelta


def sample(tokens: int = 3, status: int = 200, sent_at: float = 0.0, ttft: float = 0.5, gap: float = 0.25,
           cached: int = 0, done: bool = True, usage: int | None = None) -> Sample:
    """A streamed request: first token `ttft` after sending, then one token every `gap` seconds."""
    if status != 200:
        return Sample(status, sent_at, None, 0.01, (), 0, None, None, None, None, False, "429 body")
    itl = (gap,) * (tokens - 1)
    return Sample(status, sent_at, ttft, ttft + sum(itl), itl, tokens, tokens if usage is None else usage, 10,
                  cached, "length", done, None, ("x",) * tokens)


def server(generated: int = 0, statuses: dict[str, int] | None = None, lookups: int = 0, hits: int = 0,
           overflow: int = 0, prefix: int = 0) -> ServerDelta:
    return ServerDelta(lookups, hits, overflow, 0, prefix, 0, generated, statuses or {}, 0.0, 0.0, 0.0)


def row(name: str, kind: str, samples: list[Sample], notes: dict | None = None, **server_kw) -> WorkloadResult:
    """A row whose server counters agree with its samples unless `server_kw` says otherwise."""
    statuses: dict[str, int] = {}
    for s in samples:
        statuses[str(s.status)] = statuses.get(str(s.status), 0) + 1
    kw = {"generated": sum(s.tokens_received for s in samples), "statuses": statuses} | server_kw
    return WorkloadResult(name, kind, len(samples), tuple(samples), server(**kw), None, notes or {})
