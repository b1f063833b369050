"""/metrics text before and after a workload -> the workload's server counters, exactly."""

from __future__ import annotations

from radianced.bench.scrape import ServerDelta, Snapshot

BEFORE = """# HELP radiance_requests_total Requests answered.
# TYPE radiance_requests_total counter
radiance_requests_total{status="200"} 5.0
radiance_requests_created{status="200"} 1.7e9
# TYPE radiance_generation_tokens_total counter
radiance_generation_tokens_total 100.0
# TYPE radiance_expert_lookups_total counter
radiance_expert_lookups_total 1000.0
# TYPE radiance_expert_hits_total counter
radiance_expert_hits_total 900.0
# TYPE radiance_expert_overflow_bytes_total counter
radiance_expert_overflow_bytes_total 4096.0
# TYPE radiance_prefix_cache_hit_tokens_total counter
radiance_prefix_cache_hit_tokens_total 32.0
# TYPE radiance_kv_util gauge
radiance_kv_util 0.5
"""

AFTER = """# TYPE radiance_requests_total counter
radiance_requests_total{status="200"} 9.0
radiance_requests_total{status="429"} 32.0
# TYPE radiance_generation_tokens_total counter
radiance_generation_tokens_total 164.0
# TYPE radiance_prompt_tokens_total counter
radiance_prompt_tokens_total 80.0
# TYPE radiance_expert_lookups_total counter
radiance_expert_lookups_total 1400.0
# TYPE radiance_expert_hits_total counter
radiance_expert_hits_total 1200.0
# TYPE radiance_expert_overflow_bytes_total counter
radiance_expert_overflow_bytes_total 413696.0
# TYPE radiance_prefix_cache_hit_tokens_total counter
radiance_prefix_cache_hit_tokens_total 240.0
# TYPE radiance_kv_util gauge
radiance_kv_util 0.0
# TYPE radiance_sequences_running gauge
radiance_sequences_running 0.0
"""


def test_counters_are_differenced_and_gauges_read_after():
    d = ServerDelta.between(Snapshot.parse(BEFORE), Snapshot.parse(AFTER))
    assert d == ServerDelta(expert_lookups=400, expert_hits=300, overflow_bytes=409600, disk_bytes=0,
                            prefix_hit_tokens=208, prompt_tokens=80, generated_tokens=64,
                            requests_by_status={"200": 4, "429": 32}, kv_util_after=0.0, running_after=0.0,
                            waiting_after=None)
    assert d.hit_rate == 0.75 and d.overflow_share == 0.25


LABELLED = """# TYPE radiance_expert_lookups_total counter
radiance_expert_lookups_total{step="decode"} %d
radiance_expert_lookups_total{step="prefill"} %d
# TYPE radiance_expert_hits_total counter
radiance_expert_hits_total{step="decode"} %d
radiance_expert_hits_total{step="prefill"} %d
# TYPE radiance_expert_overflow_bytes_total counter
radiance_expert_overflow_bytes_total{step="decode"} %d
radiance_expert_overflow_bytes_total{step="prefill"} %d
# TYPE radiance_step_tokens_total counter
radiance_step_tokens_total{step="decode"} %d
radiance_step_tokens_total{step="prefill"} %d
"""


def test_the_decode_steps_are_read_apart_from_a_prompts():
    """The daemon's expert counters by step kind: the totals sum the kinds, the decode fields are the decode steps'
    alone (a prompt of 256 tokens routed to most experts: 70% hits against the decodes' 90%)."""
    before = Snapshot.parse(LABELLED % (100, 0, 90, 0, 10 * 4096, 0, 10, 0))
    after = Snapshot.parse(LABELLED % (1100, 1000, 990, 700, 110 * 4096, 300 * 4096, 110, 256))
    d = ServerDelta.between(before, after)
    assert (d.expert_lookups, d.expert_hits, d.overflow_bytes) == (2000, 1600, 400 * 4096)
    assert (d.decode_lookups, d.decode_hits, d.decode_overflow_bytes, d.decode_tokens) == (1000, 900, 100 * 4096, 100)
    assert d.hit_rate == 0.8 and d.decode_hit_rate == 0.9 and d.decode_overflow_per_token == 4096
    nothing = ServerDelta.between(Snapshot.parse(BEFORE), Snapshot.parse(BEFORE))
    assert nothing.decode_hit_rate is None and nothing.decode_overflow_per_token is None


def test_a_dense_model_routes_nothing_and_has_no_hit_rate():
    same = Snapshot.parse(BEFORE)
    d = ServerDelta.between(same, same)
    assert d.expert_lookups == 0 and d.hit_rate is None and d.overflow_share is None
    assert d.requests_by_status == {}  # statuses with no new answer are left out


def test_the_created_samples_are_not_counted_as_totals():
    assert Snapshot.parse(BEFORE).total("radiance_requests") == 5.0
