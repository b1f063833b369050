"""/metrics: a private registry whose exposition prometheus_client's parser reads, with values that move."""

from __future__ import annotations

from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from radianced.server.metrics import TTFT_BUCKETS, Metrics


def samples(m: Metrics) -> dict[tuple[str, tuple], float]:
    text, content_type = m.render()
    assert content_type.startswith("text/plain; version=")  # the text exposition format
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def test_fresh_metrics_parse_and_start_at_zero():
    s = samples(Metrics())
    for name in ("radiance_prompt_tokens_total", "radiance_generation_tokens_total",
                 "radiance_prefix_cache_hit_tokens_total", "radiance_sequences_running",
                 "radiance_sequences_waiting", "radiance_kv_util", "radiance_time_to_first_token_seconds_count",
                 "radiance_inter_token_latency_seconds_count", "radiance_e2e_request_latency_seconds_count",
                 "radiance_step_duration_seconds_count", "radiance_step_loop_wait_seconds_count",
                 "radiance_step_launch_seconds_count", "radiance_step_launch_wait_seconds_count"):
        assert s[(name, ())] == 0.0, name
    assert not any(name == "radiance_requests_total" for name, _ in s)  # no status seen yet
    assert not any(name.startswith(("process_", "python_gc")) for name, _ in s)  # not the global registry


def test_values_move_as_requests_complete():
    m = Metrics()
    m.on_request_done(200)
    m.on_request_done(200)
    m.on_request_done("429")
    m.add_prompt_tokens(12)
    m.add_prompt_tokens(3)
    m.add_generated_tokens(7)
    m.add_prefix_hit_tokens(16)
    m.observe_ttft(0.03)
    m.observe_ttft(3.0)
    for dt in (0.002, 0.004, 0.004):
        m.observe_inter_token(dt)
    m.observe_e2e(1.25)
    m.observe_step(0.0045)
    m.set_running(2)
    m.set_waiting(5)
    m.set_kv_util(0.375)
    m.set_waiting(4)
    m.add_expert_lookups("prefill", 40, 30, 10 * 4096)
    m.add_expert_lookups("decode", 8, 8, 0)
    m.add_expert_lookups("decode", 4, 2, 2 * 4096)
    m.add_step_tokens("prefill", 32)
    m.add_step_tokens("decode", 2)
    s = samples(m)
    assert s[("radiance_requests_total", (("status", "200"),))] == 2.0
    assert s[("radiance_requests_total", (("status", "429"),))] == 1.0
    assert s[("radiance_prompt_tokens_total", ())] == 15.0
    assert s[("radiance_generation_tokens_total", ())] == 7.0
    assert s[("radiance_prefix_cache_hit_tokens_total", ())] == 16.0
    assert (s[("radiance_sequences_running", ())], s[("radiance_sequences_waiting", ())]) == (2.0, 4.0)
    assert s[("radiance_kv_util", ())] == 0.375
    assert s[("radiance_expert_lookups_total", (("step", "prefill"),))] == 40.0
    assert s[("radiance_expert_lookups_total", (("step", "decode"),))] == 12.0
    assert s[("radiance_expert_hits_total", (("step", "prefill"),))] == 30.0
    assert s[("radiance_expert_hits_total", (("step", "decode"),))] == 10.0
    assert s[("radiance_step_tokens_total", (("step", "decode"),))] == 2.0
    assert s[("radiance_expert_overflow_bytes_total", (("step", "prefill"),))] == 40960.0
    assert s[("radiance_expert_overflow_bytes_total", (("step", "decode"),))] == 8192.0
    assert s[("radiance_time_to_first_token_seconds_count", ())] == 2.0
    assert s[("radiance_time_to_first_token_seconds_sum", ())] == 3.03
    assert s[("radiance_time_to_first_token_seconds_bucket", (("le", "0.04"),))] == 1.0
    assert s[("radiance_time_to_first_token_seconds_bucket", (("le", "2.5"),))] == 1.0
    assert s[("radiance_time_to_first_token_seconds_bucket", (("le", "5.0"),))] == 2.0
    assert s[("radiance_inter_token_latency_seconds_bucket", (("le", "0.0025"),))] == 1.0
    assert s[("radiance_inter_token_latency_seconds_bucket", (("le", "0.005"),))] == 3.0
    assert s[("radiance_e2e_request_latency_seconds_sum", ())] == 1.25
    assert s[("radiance_step_duration_seconds_bucket", (("le", "0.005"),))] == 1.0
    assert len([k for k in s if k[0] == "radiance_time_to_first_token_seconds_bucket"]) == len(TTFT_BUCKETS) + 1


def test_two_daemons_in_one_process_do_not_share_metrics():
    a, b = Metrics(), Metrics()
    a.add_generated_tokens(5)
    assert samples(b)[("radiance_generation_tokens_total", ())] == 0.0
    assert REGISTRY.get_sample_value("radiance_generation_tokens_total") is None


def test_tier_metrics_disk_reads_arena_pages_and_moves():
    m = Metrics()
    m.add_expert_disk_reads(3 * 4096, [0.0004, 0.002, 0.03])
    m.add_expert_disk_reads(0, [])
    m.set_arena_pages("kv", 12)
    m.set_arena_pages("experts", 20)
    m.set_arena_pages("kv", 10)
    m.add_pages_moved("experts", "kv", 3)
    m.add_pages_moved("experts", "kv", 2)
    m.add_pages_moved("kv", "experts", 1)
    s = samples(m)
    assert s[("radiance_expert_disk_bytes_total", ())] == 12288.0
    assert s[("radiance_expert_disk_read_seconds_count", ())] == 3.0
    assert s[("radiance_expert_disk_read_seconds_bucket", (("le", "0.0005"),))] == 1.0
    assert s[("radiance_expert_disk_read_seconds_bucket", (("le", "0.0025"),))] == 2.0
    assert s[("radiance_expert_disk_read_seconds_bucket", (("le", "0.05"),))] == 3.0
    assert s[("radiance_arena_pages", (("tenant", "kv"),))] == 10.0
    assert s[("radiance_arena_pages", (("tenant", "experts"),))] == 20.0
    assert s[("radiance_arena_pages_moved_total", (("from", "experts"), ("to", "kv")))] == 5.0
    assert s[("radiance_arena_pages_moved_total", (("from", "kv"), ("to", "experts")))] == 1.0


def test_the_kv_util_help_names_the_kv_dtype():
    for kv_dtype in ("auto", "fp8"):
        text = Metrics(kv_dtype=kv_dtype).render()[0].decode()
        assert (f"# HELP radiance_kv_util Share of KV blocks in use (0 to 1); the KV cache in {kv_dtype} "
                "(--kv-cache-dtype).") in text.splitlines()


def test_kernel_builds_are_exported_as_zero_while_serving_from_the_start():
    m = Metrics()
    assert samples(m)[("radiance_kernel_builds_total", (("kind", "compile"), ("phase", "serving")))] == 0.0
    m.add_kernel_build("start-up", "compile")
    m.add_kernel_build("serving", "autotune")
    s = samples(m)
    assert s[("radiance_kernel_builds_total", (("kind", "compile"), ("phase", "start-up")))] == 1.0
    assert s[("radiance_kernel_builds_total", (("kind", "autotune"), ("phase", "serving")))] == 1.0


def test_the_cuda_allocator_counters_are_read_at_each_scrape(monkeypatch):
    """No GPU here: torch.cuda.memory_stats stands in, and each scrape reads it anew."""
    stats = {"num_device_alloc": 5, "num_device_free": 2, "num_alloc_retries": 0}
    host = {"num_host_alloc": 3, "host_alloc_time.total": 2500}  # microseconds
    monkeypatch.setattr("torch.cuda.memory_stats", lambda device: dict(stats))
    monkeypatch.setattr("torch.cuda.host_memory_stats", lambda: dict(host))
    m = Metrics()
    m.watch_cuda_allocator("cuda:0")
    s = samples(m)
    assert [s[(f"radiance_cuda_allocator_{n}_total", ())] for n in ("mallocs", "frees", "retries")] == [5, 2, 0]
    assert s[("radiance_cuda_host_allocs_total", ())] == 3 and s[("radiance_cuda_host_alloc_seconds_total", ())] == 0.0025
    stats.update(num_device_alloc=9, num_alloc_retries=1)
    host.update(num_host_alloc=4)
    s = samples(m)
    assert [s[(f"radiance_cuda_allocator_{n}_total", ())] for n in ("mallocs", "frees", "retries")] == [9, 2, 1]
    assert s[("radiance_cuda_host_allocs_total", ())] == 4


def test_step_times_by_kind():
    m = Metrics()
    m.observe_step_kind("decode", 0.002)
    m.observe_step_kind("decode", 0.003)
    m.observe_step_kind("mixed", 0.01)
    s = samples(m)
    assert s[("radiance_step_own_seconds_count", (("kind", "decode"),))] == 2
    assert abs(s[("radiance_step_own_seconds_sum", (("kind", "decode"),))] - 0.005) < 1e-12
    assert s[("radiance_step_own_seconds_count", (("kind", "mixed"),))] == 1
