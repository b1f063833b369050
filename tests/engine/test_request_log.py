"""engine/request_log.py: the finished request's log lines (SPEC §9)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from radianced.engine.request_log import expert_line, request_line


def test_the_request_line_says_prompt_reuse_times_rate_and_drafts():
    now = time.perf_counter()
    line = request_line("r1", 100, 64, now - 1.0, now - 0.5, 11, SimpleNamespace(drafted=8, accepted=6), "length")
    head, rest = line.split(" read in ")
    assert head == "r1: prompt 100 tokens = 64 reused + 36"
    ttft, rest = rest.split(" ms, 11 generated in ")
    assert abs(int(ttft) - 500) <= 2
    decode, rest = rest.split(" ms (")
    assert abs(int(decode) - 500) <= 2 and rest.startswith("20.0 tok/s")  # 10 tokens after the first in 0.5 s
    assert rest.endswith("tok/s), drafts accepted 6/8 (75.0%) [length]")


def test_a_request_that_never_sampled_reads_zero_rates():
    now = time.perf_counter()
    line = request_line("r2", 5, 0, now, None, 0, SimpleNamespace(drafted=0, accepted=0), "abort")
    assert line.endswith("0 generated in 0 ms (0.0 tok/s), drafts accepted 0/0 (0.0%) [abort]")


def test_the_expert_line_gives_hit_rate_and_misses():
    assert expert_line(40, 30, 64, 16) == ("decode expert cache hit rate: 75.0% (30 hits / 40 lookups); 10 more read "
                                           "over PCIe or from disk (25.0% of all 64 routed)")
    assert expert_line(0, 0, 0, 0).startswith("decode expert cache hit rate: 0.0% (0 hits / 0 lookups)")
