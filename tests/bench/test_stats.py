"""The metric math on fixed samples: vLLM's definitions of TTFT, TPOT, ITL and throughput."""

from __future__ import annotations

import pytest

from radianced.bench.stats import Distribution, slope_per_minute, summarize
from tests.bench.samples import sample


def test_percentiles_interpolate_linearly_between_closest_ranks():
    d = Distribution.of([float(x) for x in range(1, 11)])
    assert (d.count, d.mean, d.p50, d.max) == (10, 5.5, 5.5, 10.0)
    assert d.p95 == pytest.approx(9.55) and d.p99 == pytest.approx(9.91)


def test_a_single_value_is_every_percentile_and_no_value_is_none():
    assert Distribution.of([0.3]) == Distribution(1, 0.3, 0.3, 0.3, 0.3, 0.3)
    assert Distribution.of([]) == Distribution(0, None, None, None, None, None)


def test_tpot_is_time_after_the_first_token_over_the_tokens_after_it():
    s = sample(tokens=5, ttft=0.5, gap=0.25)  # e2e = 0.5 + 4 * 0.25
    assert s.e2e_s == 1.5 and s.tpot_s == pytest.approx(0.25)
    assert sample(tokens=1).tpot_s is None  # one token has no time per output token


def test_summary_pools_itl_over_requests_and_counts_only_successful_tokens():
    samples = [sample(tokens=3, sent_at=0.0, ttft=0.5, gap=0.25),  # ends at 1.0
               sample(tokens=5, sent_at=0.5, ttft=1.0, gap=0.5),  # ends at 3.5
               sample(status=429, sent_at=0.2)]
    s = summarize(samples)
    assert (s.requests, s.ok, s.status_counts, s.cut_short) == (3, 2, {200: 2, 429: 1}, 0)
    assert s.output_tokens == 8 and s.prompt_tokens == 20
    assert s.duration_s == 3.5 and s.output_tok_s == pytest.approx(8 / 3.5) and s.request_s == pytest.approx(2 / 3.5)
    assert s.itl.count == 2 + 4 and s.itl.max == 0.5  # every gap of every request
    assert (s.ttft.count, s.ttft.p50) == (2, 0.75)
    assert s.tpot.p50 == pytest.approx(0.375)  # the two requests' TPOTs: 0.25 and 0.5
    assert s.e2e.max == 3.0


def test_a_stream_without_done_or_with_missing_tokens_is_cut_short():
    assert sample(done=False).cut_short and not sample(done=False).ok
    assert sample(tokens=3, usage=4).cut_short  # the usage says 4, only 3 arrived
    assert not sample().cut_short and not sample(status=429).cut_short


def test_slope_per_minute_is_the_least_squares_slope():
    assert slope_per_minute([0, 60, 120], [100.0, 101.0, 102.0]) == pytest.approx(1.0)
    assert slope_per_minute([0], [1.0]) is None
