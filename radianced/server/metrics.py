"""Prometheus metrics of one daemon, in a registry of their own.

The engine and the HTTP layer report through `Metrics`' methods; `/metrics`
serves `render()`. A private `CollectorRegistry` (not prometheus_client's
global one) keeps two daemons in one test process apart and leaves out the
client library's process and GC collectors.

Names follow Prometheus conventions: counters end in `_total`, durations are
histograms in `_seconds`.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from radianced.server.gc_pauses import GcPauses

# Buckets reach down to a millisecond: a small model on a big card decodes a token in ~2 ms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                 1.0, 2.5, 5.0, 10.0)
# A step's tokens' wait for the event loop: ~0.1 ms when nothing is queued ahead of them, ms behind HTTP work.
LOOP_WAIT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
# One expert read with O_DIRECT: ~0.1 ms for a small extent from NVMe, up to seconds on a slow or busy disk.
DISK_READ_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0)


class Metrics:
    """The daemon's counters, gauges and histograms.

    Methods only add to or set metrics; none raises for a valid number. Not
    thread-safe beyond what prometheus_client guarantees (each update is
    atomic); call from the event loop.
    """

    def __init__(self, kv_dtype: str = "auto") -> None:
        """kv_dtype: the daemon's `--kv-cache-dtype`, named in radiance_kv_util's help."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._requests = Counter("radiance_requests", "Requests answered, by HTTP status "
                                 "(499: the client went away first).", ["status"], registry=r)
        self._ttft = Histogram("radiance_time_to_first_token_seconds", "Arrival to the first generated token.",
                               buckets=TTFT_BUCKETS, registry=r)
        self._itl = Histogram("radiance_inter_token_latency_seconds", "Time between two tokens of one request.",
                              buckets=TOKEN_BUCKETS, registry=r)
        self._e2e = Histogram("radiance_e2e_request_latency_seconds", "Arrival to the last token of a request.",
                              buckets=E2E_BUCKETS, registry=r)
        self._prompt = Counter("radiance_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self._generated = Counter("radiance_generation_tokens", "Tokens generated.", registry=r)
        self._prefix_hits = Counter("radiance_prefix_cache_hit_tokens",
                                    "Prompt tokens whose KV the prefix cache supplied.", registry=r)
        self._running = Gauge("radiance_sequences_running", "Sequences in the running batch.", registry=r)
        self._waiting = Gauge("radiance_sequences_waiting", "Sequences waiting for a slot.", registry=r)
        self._kv_util = Gauge("radiance_kv_util", f"Share of KV blocks in use (0 to 1); the KV cache in {kv_dtype} "
                              "(--kv-cache-dtype).", registry=r)
        # by step kind (decode, mixed, prefill: as radiance_step_own_seconds), so the decode steps' hit rate and
        # link bytes a token, which the plan predicts, are read apart from a prompt's, which routes to most experts
        self._expert_lookups = Counter("radiance_expert_lookups", "Routed-expert lookups: one per (step, layer, "
                                       "distinct expert the step routed), by step kind.", ["step"], registry=r)
        self._expert_hits = Counter("radiance_expert_hits", "Expert lookups that found the expert in a VRAM slot, "
                                    "by step kind.", ["step"], registry=r)
        self._expert_overflow = Counter("radiance_expert_overflow_bytes", "Expert bytes read over the link "
                                        "(missed lookups x expert extent bytes), by step kind.", ["step"], registry=r)
        self._step_tokens = Counter("radiance_step_tokens", "Tokens the steps computed (prompt and generated, drafts "
                                    "included), by step kind.", ["step"], registry=r)
        self._disk_bytes = Counter("radiance_expert_disk_bytes", "Expert bytes the disk tier read from the model "
                                   "file (O_DIRECT).", registry=r)
        self._disk_read = Histogram("radiance_expert_disk_read_seconds", "Wall time of one expert read by the "
                                    "disk tier.", buckets=DISK_READ_BUCKETS, registry=r)
        self._arena_pages = Gauge("radiance_arena_pages", "Arena pages held, by tenant (kv, experts).", ["tenant"],
                                  registry=r)
        self._pages_moved = Counter("radiance_arena_pages_moved", "Arena pages one tenant took back from another "
                                    "(lending), by from and to tenant.", ["from", "to"], registry=r)
        self._drafted = Counter("radiance_spec_draft_tokens", "Drafted tokens verified (speculative decoding).",
                                registry=r)
        self._accepted = Counter("radiance_spec_accepted_tokens", "Drafted tokens the verify step accepted.",
                                 registry=r)
        self._drafted_at = Counter("radiance_spec_draft_tokens_by_position", "Drafted tokens verified, by their "
                                   "position among a step's drafts (1: the first).", ["position"], registry=r)
        self._accepted_at = Counter("radiance_spec_accepted_tokens_by_position", "Drafted tokens accepted, by their "
                                    "position among a step's drafts (1: the first).", ["position"], registry=r)
        self._kernel_builds = Counter("radiance_kernel_builds", "Kernel variants built in this process, by phase "
                                      "(start-up; serving: a request waited for it) and kind (compile: a Triton "
                                      "variant; autotune: an autotuner's new key).", ["phase", "kind"], registry=r)
        for kind in ("compile", "autotune"):
            self._kernel_builds.labels(phase="serving", kind=kind)  # exported as 0 from the start
        self._step = Histogram("radiance_step_duration_seconds", "Wall time of one engine step.",
                               buckets=TOKEN_BUCKETS, registry=r)
        self._loop_wait = Histogram("radiance_step_loop_wait_seconds", "From a step's end on the step thread to "
                                    "its tokens' dispatch on the event loop (HTTP work queued ahead delays the "
                                    "streams; the steps only through the GIL the two threads share).",
                                    buckets=LOOP_WAIT_BUCKETS, registry=r)
        self._launch = Histogram("radiance_step_launch_seconds", "Wall time of one step's launch on the step thread "
                                 "(on CUDA it queues the step's work: the graph replay or the eager kernels, the "
                                 "sampler, the copies back).", buckets=LOOP_WAIT_BUCKETS, registry=r)
        self._launch_wait = Histogram("radiance_step_launch_wait_seconds", "Of a launch's wall time, what the step "
                                      "thread did not run (wall minus its CPU time): waiting for the GIL while the "
                                      "event loop runs Python, or for a core.", buckets=LOOP_WAIT_BUCKETS, registry=r)
        self._step_kind = Histogram("radiance_step_own_seconds", "One step's own time on the device (CUDA events "
                                    "around it; on the CPU its launch), by kind: decode, mixed (decodes beside "
                                    "prefill), prefill.", ["kind"], buckets=TOKEN_BUCKETS, registry=r)

    # -- per request ----------------------------------------------------------

    def on_request_done(self, status: int | str) -> None:
        """A request was answered with HTTP `status` (use 499 for a client that disconnected)."""
        self._requests.labels(status=str(status)).inc()

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self._e2e.observe(seconds)

    def add_prompt_tokens(self, n: int) -> None:
        self._prompt.inc(n)

    def add_generated_tokens(self, n: int) -> None:
        self._generated.inc(n)

    def add_prefix_hit_tokens(self, n: int) -> None:
        self._prefix_hits.inc(n)

    # -- per step -------------------------------------------------------------

    def observe_step(self, seconds: float) -> None:
        self._step.observe(seconds)

    def observe_loop_wait(self, seconds: float) -> None:
        self._loop_wait.observe(seconds)

    def observe_launch(self, seconds: float, waited: float) -> None:
        self._launch.observe(seconds)
        self._launch_wait.observe(max(0.0, waited))

    def observe_step_kind(self, kind: str, seconds: float) -> None:
        """One step's own time (engine/step_timer.py) by kind: decode, mixed (decodes and prefill), prefill."""
        self._step_kind.labels(kind=kind).observe(seconds)

    def add_step_tokens(self, kind: str, n: int) -> None:
        """A step of `kind` (decode, mixed, prefill) computed n tokens."""
        self._step_tokens.labels(step=kind).inc(n)

    def add_expert_lookups(self, kind: str, lookups: int, hits: int, overflow_bytes: int) -> None:
        """A step's (of `kind`) expert lookups, hits among them, and bytes the misses read over the link."""
        self._expert_lookups.labels(step=kind).inc(lookups)
        self._expert_hits.labels(step=kind).inc(hits)
        self._expert_overflow.labels(step=kind).inc(overflow_bytes)

    def add_expert_disk_reads(self, nbytes: int, seconds: Sequence[float]) -> None:
        """Bytes the disk tier read since the last call, and the time of each expert read."""
        self._disk_bytes.inc(nbytes)
        for t in seconds:
            self._disk_read.observe(t)

    def add_drafts(self, drafted: int, accepted: int) -> None:
        """One sequence's verify step: `drafted` drafts, of which the first `accepted` were accepted."""
        self._drafted.inc(drafted)
        self._accepted.inc(accepted)
        for position in range(1, drafted + 1):
            self._drafted_at.labels(position=str(position)).inc()
            if position <= accepted:
                self._accepted_at.labels(position=str(position)).inc()

    def watch_cuda_allocator(self, device) -> None:
        """Export torch's CUDA caching allocator counters (`CudaAllocator`), read at each scrape."""
        self.registry.register(CudaAllocator(device))

    def watch_gc(self) -> GcPauses:
        """Time the interpreter's garbage collections (`GcPauses`) until the caller closes it."""
        return GcPauses(self.registry)

    def add_kernel_build(self, phase: str, kind: str) -> None:
        self._kernel_builds.labels(phase=phase, kind=kind).inc()

    def set_arena_pages(self, tenant: str, pages: int) -> None:
        self._arena_pages.labels(tenant=tenant).set(pages)

    def add_pages_moved(self, src: str, dst: str, pages: int) -> None:
        """`pages` more pages of tenant `src` were taken back for tenant `dst`."""
        self._pages_moved.labels(**{"from": src, "to": dst}).inc(pages)

    def set_running(self, n: int) -> None:
        self._running.set(n)

    def set_waiting(self, n: int) -> None:
        self._waiting.set(n)

    def set_kv_util(self, fraction: float) -> None:
        self._kv_util.set(fraction)

    # -- exposition -----------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The text exposition format and its Content-Type, for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class CudaAllocator:
    """torch's CUDA caching allocator as counters, read from `torch.cuda.memory_stats` at each scrape:
    its cudaMalloc and cudaFree calls, and its retries (a cudaMalloc that failed, so the allocator freed
    its whole cache, which waits for the device, and tried again). On a card the arena fills, a step of a
    shape the cache cannot serve pays for these on the request path; growing counts while serving say so.
    Beside them the pinned host allocator's (`torch.cuda.host_memory_stats`): a step's host-to-device copies
    stage through pinned blocks (model/batch.py), and a block it has not cached is a cudaHostAlloc (pinning
    pages, milliseconds for megabytes) on the step thread."""

    def __init__(self, device) -> None:
        self.device = device

    def collect(self):
        import torch

        stats = torch.cuda.memory_stats(self.device)
        for name, key, help_text in (
                ("radiance_cuda_allocator_mallocs", "num_device_alloc", "cudaMalloc calls by torch's allocator."),
                ("radiance_cuda_allocator_frees", "num_device_free", "cudaFree calls by torch's allocator."),
                ("radiance_cuda_allocator_retries", "num_alloc_retries",
                 "Allocations that failed once, emptied the allocator's cache (a device sync) and retried.")):
            yield CounterMetricFamily(name, help_text, value=stats.get(key, 0))
        host = torch.cuda.host_memory_stats()
        yield CounterMetricFamily("radiance_cuda_host_allocs", "cudaHostAlloc calls by torch's pinned allocator.",
                                  value=host.get("num_host_alloc", 0))
        yield CounterMetricFamily("radiance_cuda_host_alloc_seconds", "Seconds in those cudaHostAlloc calls.",
                                  value=host.get("host_alloc_time.total", 0) / 1e6)
