"""A run's rows -> its checks, a JSON document with every sample, and a Markdown table.

The checks are the run's internal consistency, computed from the samples
alone (no timing enters any of them): every successful stream's token count
equals its usage count, the overload burst got exactly its excess as 429s, no
5xx or stream cut short anywhere, the quality row matched its reference, and
the daemon's own /metrics counted, row by row, the tokens and the answers (by
status) that the client received (this one assumes the bench is the daemon's
only client while it runs). `bench run` exits non-zero when one fails.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from radianced.bench.energy import MIN_UPDATES
from radianced.bench.loop_lag import client_bound
from radianced.bench.result import WorkloadResult
from radianced.bench.stats import Distribution

NOT_MEASURED = "not measured"
TOO_SHORT = "too short"  # the row's energy spans too few of the counter's updates (bench/energy.py)


@dataclass(frozen=True)
class Report:
    """Everything one `bench run` measured."""

    meta: dict[str, Any]  # url, model, mode, daemon limits, device, date, radianced commit
    rows: tuple[WorkloadResult, ...]  # in the order they ran

    def checks(self) -> dict[str, bool | None]:
        """Each consistency check: True passed, False failed, None not applicable in this run."""
        samples = [s for r in self.rows for s in r.samples]
        overload = self._row("overload")
        quality = self._row("quality")
        return {
            "tokens_counted_equal_tokens_received": all(s.tokens_received == s.completion_tokens
                                                        for s in samples if s.ok),
            "overload_429_equal_excess": None if overload is None
            else overload.notes["got_429"] == overload.notes["expected_429"],
            "no_5xx": all(s.status < 500 for s in samples),
            "no_stream_cut_short": not any(s.cut_short for s in samples),
            "no_error_outside_overload": all(s.ok for r in self.rows if r.kind != "overload" for s in r.samples),
            "quality_matches_reference": None if quality is None else quality.notes["match"],
            "server_counts_equal_client_counts": all(_server_agrees(r) for r in self.rows),
        }

    @property
    def passed(self) -> bool:
        return all(v is not False for v in self.checks().values())

    def _row(self, name: str) -> WorkloadResult | None:
        return next((r for r in self.rows if r.name == name), None)

    def to_json(self) -> dict[str, Any]:
        return {"meta": self.meta, "checks": self.checks(), "workloads": [_row_json(r) for r in self.rows]}

    def markdown(self) -> str:
        lines = [f"# radianced serving benchmark: {self.meta.get('model')}", "",
                 ", ".join(f"{k}: {v}" for k, v in self.meta.items() if not isinstance(v, dict)), "",
                 "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        lines += ["| " + " | ".join(_cells(r)) + " |" for r in self.rows]
        lines += ["", "Times in ms (p50/p95/p99). Energy: " + ("NVML, excluding load and warm-up"
                  if any(r.energy for r in self.rows) else NOT_MEASURED + " (no NVIDIA GPU with an energy counter)")]
        short = [r for r in self.rows if r.energy and not r.energy.resolved]
        if short:
            lines += ["", f"{TOO_SHORT}: the row ran under {MIN_UPDATES} of the energy counter's updates (every "
                      f"{short[0].energy.update_s * 1000:.0f} ms), so its energy could be off by over 10%: "
                      + ", ".join(f"{r.name} ({r.energy.seconds:.2f} s)" for r in short)
                      + ". The full mode's longer rows measure it."]
        bound = [f"{r.name} (lag p99 {_ms(r.client_lag.p99)} ms)" for r in self.rows
                 if client_bound(r.client_lag, r.summary.itl)]
        if bound:
            lines += ["", f"{CLIENT_BOUND_MARK.strip()} the client's own event loop lagged at least the row's ITL p50: its "
                      "TTFT and ITL time the client as much as the daemon: " + ", ".join(bound) + "."]
        lines += ["", "## Checks", ""]
        lines += [f"- {name}: {_verdict(v)}" for name, v in self.checks().items()]
        for r in self.rows:
            if r.notes:
                lines += ["", f"## {r.name}", ""] + [f"- {k}: {_fmt_note(v)}" for k, v in r.notes.items()]
        return "\n".join(lines) + "\n"


HEADER = ("workload", "c", "requests", "ok", "out tok", "out tok/s", "TTFT ms", "TPOT p50 ms", "ITL ms",
          "expert hit rate", "overflow MiB", "prefix-hit tok", "J/tok", "mean W")


CLIENT_BOUND_MARK = " [c]"


def _cells(r: WorkloadResult) -> list[str]:
    s, d = r.summary, r.server
    mark = CLIENT_BOUND_MARK if client_bound(r.client_lag, s.itl) else ""
    return [r.name, str(r.concurrency), str(s.requests), str(s.ok), str(s.output_tokens), _num(s.output_tok_s, 1),
            _pcts(s.ttft) + mark, _ms(s.tpot.p50), _pcts(s.itl) + mark,
            _hit_rate(d),
            f"{d.overflow_bytes / 2**20:.1f}", str(d.prefix_hit_tokens),
            *_energy_cells(r)]


def _hit_rate(d) -> str:
    """The row's expert hit rate, and its decode steps' where a prompt's steps are in the row too (a prompt routes to
    most experts: the decode steps' rate is the one the plan predicts and a long conversation sees)."""
    if d.hit_rate is None:
        return "-"
    if d.decode_hit_rate is None or d.decode_lookups == d.expert_lookups:
        return f"{d.hit_rate:.1%}"
    return f"{d.hit_rate:.1%} (decode {d.decode_hit_rate:.1%})"


def _energy_cells(r: WorkloadResult) -> list[str]:
    """J/tok and mean W, or why not: no meter, or a row too short for the counter's updates."""
    if r.energy is None:
        return [NOT_MEASURED] * 2
    if not r.energy.resolved:
        return [TOO_SHORT] * 2
    return [_num(r.joules_per_token, 3), f"{r.energy.mean_w:.0f}"]


def _server_agrees(r: WorkloadResult) -> bool:
    """The daemon's generated tokens and answers by status, over the row, equal what the client received."""
    statuses = {str(k): v for k, v in r.summary.status_counts.items()}
    return (r.server.generated_tokens == sum(s.tokens_received for s in r.samples)
            and r.server.requests_by_status == statuses)


def _row_json(r: WorkloadResult) -> dict[str, Any]:
    server = dataclasses.asdict(r.server) | {"hit_rate": r.server.hit_rate, "overflow_share": r.server.overflow_share,
                                             "decode_hit_rate": r.server.decode_hit_rate,
                                             "decode_overflow_per_token": r.server.decode_overflow_per_token}
    energy: Any = NOT_MEASURED
    if r.energy is not None:
        energy = dataclasses.asdict(r.energy) | {"mean_w": r.energy.mean_w, "joules_per_token": r.joules_per_token,
                                                 "resolved": r.energy.resolved}
    lag = None if r.client_lag is None else dataclasses.asdict(r.client_lag) | {
        "client_bound": client_bound(r.client_lag, r.summary.itl)}
    return {"name": r.name, "kind": r.kind, "concurrency": r.concurrency,
            "summary": dataclasses.asdict(r.summary), "server": server, "energy": energy, "notes": r.notes,
            "client_lag": lag,
            "samples": [dataclasses.asdict(s) for s in r.samples]}


def _pcts(d: Distribution) -> str:
    return "-" if d.count == 0 else f"{_ms(d.p50)}/{_ms(d.p95)}/{_ms(d.p99)}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _verdict(v: bool | None) -> str:
    return {True: "pass", False: "FAIL", None: "not run"}[v]


def _fmt_note(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return json.dumps(v, ensure_ascii=False) if isinstance(v, str) and "\n" in v else str(v)
