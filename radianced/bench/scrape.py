"""The daemon's /metrics before and after a workload -> what the workload did on the server.

The text is parsed with prometheus_client's own parser. Counters are
differenced (after - before); gauges are read after. Names are the daemon's
(radianced/server/metrics.py); a metric the daemon does not export reads 0, so
a dense model shows no expert lookups and the report says "-" for its hit rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# counter families (the parser drops the _total suffix from a family's name)
LOOKUPS = "radiance_expert_lookups"
HITS = "radiance_expert_hits"
OVERFLOW = "radiance_expert_overflow_bytes"
DISK = "radiance_expert_disk_bytes"
STEP_TOKENS = "radiance_step_tokens"  # by step kind, as the expert counters: "decode" is what the plan predicts
PREFIX_HITS = "radiance_prefix_cache_hit_tokens"
PROMPT = "radiance_prompt_tokens"
GENERATED = "radiance_generation_tokens"
REQUESTS = "radiance_requests"
KV_UTIL = "radiance_kv_util"
RUNNING = "radiance_sequences_running"
WAITING = "radiance_sequences_waiting"


@dataclass(frozen=True)
class Snapshot:
    """One read of /metrics: every sample's value by (name, sorted labels)."""

    values: dict[tuple[str, tuple[tuple[str, str], ...]], float]

    @staticmethod
    def parse(text: str) -> Snapshot:
        values = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                values[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return Snapshot(values)

    def total(self, name: str) -> float:
        """The sum of a counter's `_total` samples over all label values (0 when absent)."""
        return sum(v for (n, _), v in self.values.items() if n == name + "_total")

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """A labelled counter's `_total` samples keyed by one label's value."""
        return {dict(labels)[label]: v for (n, labels), v in self.values.items()
                if n == name + "_total" and label in dict(labels)}

    def gauge(self, name: str) -> float | None:
        return self.values.get((name, ()))


@dataclass(frozen=True)
class ServerDelta:
    """What the daemon counted during one workload (counters after minus before)."""

    expert_lookups: int  # routed-expert lookups (0 on a dense model)
    expert_hits: int  # lookups that found the expert in a VRAM slot
    overflow_bytes: int  # expert bytes read over the link by the misses
    disk_bytes: int  # expert bytes the disk tier read
    prefix_hit_tokens: int  # prompt tokens the prefix cache supplied
    prompt_tokens: int  # prompt tokens admitted
    generated_tokens: int  # tokens generated
    requests_by_status: dict[str, int]  # answered requests by HTTP status
    kv_util_after: float | None  # share of KV blocks in use when the workload ended
    running_after: float | None  # sequences still running after it
    waiting_after: float | None
    # the decode steps' share (steps that only decode: no prompt's chunk, which routes to most experts)
    decode_lookups: int = 0
    decode_hits: int = 0
    decode_overflow_bytes: int = 0
    decode_tokens: int = 0  # tokens the decode steps computed

    @property
    def decode_hit_rate(self) -> float | None:
        """The decode steps' hits / lookups; None when they routed nothing."""
        return self.decode_hits / self.decode_lookups if self.decode_lookups else None

    @property
    def decode_overflow_per_token(self) -> float | None:
        """Bytes the decode steps read over the link a token they computed; None without decode steps."""
        return self.decode_overflow_bytes / self.decode_tokens if self.decode_tokens else None

    @property
    def hit_rate(self) -> float | None:
        """hits / lookups; None when nothing was routed."""
        return self.expert_hits / self.expert_lookups if self.expert_lookups else None

    @property
    def overflow_share(self) -> float | None:
        """Share of lookups served over the link (missed): 1 - hit rate; None when nothing was routed."""
        return 1.0 - self.hit_rate if self.expert_lookups else None

    @staticmethod
    def between(before: Snapshot, after: Snapshot) -> ServerDelta:
        def d(name: str) -> int:
            return round(after.total(name) - before.total(name))

        def decode(name: str) -> int:
            was = before.by_label(name, "step").get("decode", 0.0)
            return round(after.by_label(name, "step").get("decode", 0.0) - was)

        old = before.by_label(REQUESTS, "status")
        statuses = {k: round(v - old.get(k, 0.0)) for k, v in after.by_label(REQUESTS, "status").items()}
        return ServerDelta(
            expert_lookups=d(LOOKUPS), expert_hits=d(HITS), overflow_bytes=d(OVERFLOW), disk_bytes=d(DISK),
            prefix_hit_tokens=d(PREFIX_HITS), prompt_tokens=d(PROMPT), generated_tokens=d(GENERATED),
            requests_by_status={k: v for k, v in sorted(statuses.items()) if v},
            kv_util_after=after.gauge(KV_UTIL), running_after=after.gauge(RUNNING),
            waiting_after=after.gauge(WAITING),
            decode_lookups=decode(LOOKUPS), decode_hits=decode(HITS), decode_overflow_bytes=decode(OVERFLOW),
            decode_tokens=decode(STEP_TOKENS),
        )
