"""The two lines a finished request logs (SPEC §9): its prompt, reuse and decode rate; its experts."""

from __future__ import annotations

import time


def request_line(request_id: str, prompt: int, reused: int, arrived: float, first_token: float | None,
                 generated: int, drafts, reason: str) -> str:
    """`drafts`: the sequence's draft stats (`.drafted`, `.accepted`); times from time.perf_counter()."""
    now = time.perf_counter()
    first = first_token or now
    decode_s = now - first
    rate = (generated - 1) / decode_s if generated > 1 and decode_s > 0 else 0.0
    share = 100.0 * drafts.accepted / drafts.drafted if drafts.drafted else 0.0
    return (f"{request_id}: prompt {prompt} tokens = {reused} reused + {prompt - reused} read in "
            f"{(first - arrived) * 1e3:.0f} ms, {generated} generated in {decode_s * 1e3:.0f} ms ({rate:.1f} tok/s), "
            f"drafts accepted {drafts.accepted}/{drafts.drafted} ({share:.1f}%) [{reason}]")


def expert_line(lookups: int, hits: int, routed: int, routed_from_misses: int) -> str:
    """SPEC §9's second per-request line, over the request's decode steps."""
    def pct(a: int, b: int) -> float:
        return 100.0 * a / b if b else 0.0
    return (f"decode expert cache hit rate: {pct(hits, lookups):.1f}% ({hits} hits / {lookups} lookups); "
            f"{lookups - hits} more read over PCIe or from disk "
            f"({pct(routed_from_misses, routed):.1f}% of all {routed} routed)")
