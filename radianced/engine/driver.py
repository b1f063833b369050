"""The async driver: the engine's rounds with `execute` on a worker thread, the rest on the loop.

DESIGN.md "Threads and I/O": the event loop owns the scheduler, the request
streams and the telemetry and never calls into torch; one worker thread runs
the runner. `run` is the engine's one loop (engine/engine.py: plan, execute,
apply), pipelined: the loop plans step N+1 while step N is in flight, the
worker launches N+1 and then collects N, and the loop applies N; then it turns
the step's events into stream chunks and metrics. Adds and cancels arriving
while a step runs are applied by the loop before the next plan.

The server's API: `submit()` queues a request at once (or raises `QueueFull`)
and returns its `RequestStream`; `generate()` is the same as one async iterator
that queues on its first `__anext__`. Either way, leaving the stream before its
last chunk cancels the request and frees its blocks before the next step. If the
engine task dies, every live stream raises `EngineFailed`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from radianced.engine.detokenizer import IncrementalDetokenizer
from radianced.engine.engine import Engine, Executed
from radianced.engine.engine_metrics import EngineMetrics, NoMetrics
from radianced.engine.pacing import StepPacer
from radianced.engine.request import FinishReason, Request, SeqStatus
from radianced.engine.request_log import expert_line, request_line
from radianced.engine.sampling_params import SamplingParams
from radianced.engine.scheduler import SeqEvent

log = logging.getLogger("radianced.requests")


class EngineFailed(RuntimeError):
    """The request cannot go on: the engine task died (no live request will get another
    token), or, as `RequestFailed`, a step could not compute this request."""


class RequestFailed(EngineFailed):
    """This request failed (an expert it routed to could not be read); the engine and the
    other requests go on. The message says what failed and what to do."""


@dataclass(frozen=True)
class Chunk:
    """What one step produced for a request: new token ids, the text they settle,
    and, on the last chunk, why the request ended."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: object = None
    reused_tokens: int | None = None  # on the last chunk: prompt tokens the prefix cache served


@dataclass(frozen=True)
class LiveRequest:
    """One live request as `radiancectl status` lists it."""

    request_id: str
    state: str  # "waiting" | "running"
    prompt_tokens: int
    generated: int
    age_s: float


@dataclass
class _Stream:
    """The loop's view of one live request."""

    request: Request
    detok: IncrementalDetokenizer
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    generated: int = 0
    seq: object = None  # the scheduler's Sequence (read for reuse counts)
    experts: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # decode (lookups, hits, routed, missed routed)


class RequestStream:
    """One submitted request's chunks, in order; the last has a finish_reason.

    `close()` (or `aclose()`) before the last chunk cancels the request; after
    it, or twice, it does nothing. Raises EngineFailed if the engine task dies.
    """

    def __init__(self, engine: AsyncEngine, stream: _Stream):
        self._engine = engine
        self._stream = stream
        self.done = False

    @property
    def request_id(self) -> str:
        return self._stream.request.request_id

    @property
    def num_reused_tokens(self) -> int:
        """Prompt tokens the prefix cache served (0 until the request is admitted)."""
        return self._stream.seq.num_reused_tokens or 0

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Chunk:
        if self.done:
            raise StopAsyncIteration
        chunk = await self._stream.queue.get()
        if isinstance(chunk, RequestFailed):
            self.done = True
            raise chunk
        if isinstance(chunk, BaseException):
            self.done = True
            raise EngineFailed(f"the engine failed: {chunk!r}") from chunk
        self.done = chunk.finish_reason is not None
        return chunk

    def close(self) -> None:
        if not self.done:
            self.done = True
            self._engine.cancel(self.request_id)

    async def aclose(self) -> None:
        self.close()


def step_executor() -> ThreadPoolExecutor:
    """The thread an engine's steps run on."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="radianced-step")


class AsyncEngine:
    def __init__(self, engine: Engine, metrics: EngineMetrics | None = None, pacer: StepPacer | None = None,
                 step_thread: ThreadPoolExecutor | None = None):
        """pacer: caps each step's tokens at a step time measured here (engine/pacing.py); None
        keeps the scheduler's --max-num-batched-tokens budget. step_thread: the one-worker executor
        steps run on (the daemon's, which ran the warm-up there: a thread's first steps pay its own
        set-up, torch's CPU thread team and cuBLAS handle among it); None: a new one."""
        self.engine = engine
        self.pacer = pacer
        self.scheduler = engine.scheduler
        self.metrics = metrics or NoMetrics()
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._worker = step_thread or step_executor()
        self._ids = itertools.count()
        self._failed: BaseException | None = None
        self.steps = 0  # completed steps: the watchdog's sign of progress
        self.restart_counts()

    def restart_counts(self) -> None:
        """Report the slab's and the arena's counts from here: what the start fill and the warm-up
        (engine/warmup.py: requests served before ready) did is not traffic."""
        slab, arena = self.engine.experts, self.engine.arena
        self._slab_seen = (slab.stats.total_lookups, slab.stats.total_hits) if slab is not None else None
        self._disk_seen = slab.stats.disk_bytes if slab is not None else 0
        if slab is not None:
            slab.drain_disk_latencies()
        self._moved_seen: dict[tuple[str, str], int] = dict(arena.stats().moved) if arena else {}
        self._count_tiers()  # the gauges from the start, not from the first step

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def num_live(self) -> int:
        """Requests submitted and not yet ended (waiting or running)."""
        return len(self._streams)

    @property
    def idle(self) -> bool:
        """Nothing to compute: no live request."""
        return not self.scheduler.has_unfinished

    async def run(self) -> None:
        """The engine task: the engine's rounds (engine/engine.py) until cancelled: plan and apply
        here, execute on the worker. If a round raises, every live stream raises EngineFailed and
        so does this task."""
        loop, engine = asyncio.get_running_loop(), self.engine
        start = None  # when the step being finished began (its launch's round)
        try:
            while True:
                if (work := engine.plan()) is None:  # idle, or nothing fits until a request ends
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                start = start or time.perf_counter()
                done = await loop.run_in_executor(self._worker, engine.execute, work)
                self.metrics.observe_loop_wait(time.perf_counter() - done.ended)  # the event loop's work ahead
                events = engine.apply(done)
                if done.finished is not None:
                    self._count_step(done, events, time.perf_counter() - start)
                    start = time.perf_counter() if done.launched is not None else None
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self._fail(e)
            raise
        finally:
            self._worker.shutdown(wait=True)

    def _count_step(self, done: Executed, events: list[SeqEvent], seconds: float) -> None:
        """A finished step: its time (and the next step's budget), its tokens to their streams,
        the tiers' counts."""
        self.metrics.observe_step(seconds)
        plan, own = done.finished.plan, done.output.seconds  # the step's own time, not the round's
        if own is not None:
            d = plan.decodes
            self.metrics.observe_step_kind("decode" if d == len(plan.seqs) else "mixed" if d else "prefill", own)
            if self.pacer is not None:
                decoding = sum(not s.is_prefilling for s in self.scheduler.running)
                self.scheduler.step_tokens = self.pacer.observe(plan.num_tokens, len(plan.seqs), own, decoding, d)
        self._count_experts(plan, done.output)
        for s, tokens in zip(plan.seqs, done.output.token_ids):
            if s.drafts:
                self.metrics.add_drafts(len(s.drafts), len(tokens) - 1)
        self._dispatch(events)
        self._count_tiers()
        self.steps += 1

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> RequestStream:
        """Queue a request now and return its stream. Raises QueueFull when --max-queue
        requests wait, EngineFailed when the engine task has died.

        The caller must iterate the stream to its last chunk or close it.
        """
        if self._failed is not None:
            raise EngineFailed(f"the engine failed: {self._failed!r}")
        request_id = request_id or f"req-{next(self._ids)}"
        request = Request(request_id, tuple(prompt_ids), params,
                          frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                              else frozenset(self.tokenizer.eos_token_ids)))
        stream = _Stream(request, IncrementalDetokenizer.for_request(self.tokenizer, params, prompt_ids))
        stream.seq = self.scheduler.add(request)
        self._streams[request_id] = stream
        self.metrics.add_prompt_tokens(len(prompt_ids))
        self._wake.set()
        return RequestStream(self, stream)

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[Chunk]:
        """Stream a request's output. Raises QueueFull at once when the queue is full.

        Closing the iterator early (client gone) cancels the request and frees its
        blocks before the next step.
        """
        stream = self.submit(prompt_ids, params, request_id)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            stream.close()

    def cancel(self, request_id: str) -> bool:
        """End a live request now (its blocks return at once). False if it is not live."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return False
        self.scheduler.cancel(request_id)
        self._log_done(stream, FinishReason.ABORT.value)
        reused = stream.seq.num_reused_tokens or 0
        stream.queue.put_nowait(Chunk((), stream.detok.finish().text, FinishReason.ABORT.value, None, reused))
        return True

    def cancel_all(self) -> int:
        """Cancel every live request (the end of a drain); returns how many."""
        return sum(self.cancel(request_id) for request_id in list(self._streams))

    def live(self) -> list[LiveRequest]:
        """The live requests, oldest first."""
        now = time.perf_counter()
        return [LiveRequest(s.request.request_id,
                            "waiting" if s.seq.status is SeqStatus.WAITING else "running",
                            len(s.request.prompt_token_ids), s.generated, now - s.arrived)
                for s in self._streams.values()]

    def _fail(self, error: BaseException) -> None:
        self._failed = error
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        self._streams.clear()

    def _count_experts(self, plan, output) -> None:
        """Add the step's per-sequence expert counts to their requests; the slab's step totals
        (distinct experts of the whole step: what actually moved) to the metrics."""
        if output.expert_counts is not None:
            by_seq = {s.seq.seq_id: s for s in self._streams.values()}
            for s, counts in zip(plan.seqs, output.expert_counts):
                stream = by_seq.get(s.seq_id)
                if counts is not None and stream is not None:
                    stream.experts = [a + b for a, b in zip(stream.experts, counts)]
        slab = self.engine.experts
        if slab is not None:
            lookups, hits = slab.stats.total_lookups, slab.stats.total_hits
            dl, dh = lookups - self._slab_seen[0], hits - self._slab_seen[1]
            self._slab_seen = (lookups, hits)
            self.metrics.add_expert_lookups(dl, dh, (dl - dh) * slab.extent_bytes)

    def _count_tiers(self) -> None:
        """Since the last call: the disk tier's bytes and per-expert read times, arena pages
        moved between tenants; and the pages each tenant holds now. After `settle`: its expert
        admissions read from disk and lease pages too."""
        slab, arena = self.engine.experts, self.engine.arena
        if slab is not None:
            self.metrics.add_expert_disk_reads(slab.stats.disk_bytes - self._disk_seen, slab.drain_disk_latencies())
            self._disk_seen = slab.stats.disk_bytes
        if arena is None:
            return
        stats = arena.stats()
        for tenant, pages in stats.held:
            self.metrics.set_arena_pages(tenant, pages)
        for (src, dst), n in stats.moved:
            if n > self._moved_seen.get((src, dst), 0):
                self.metrics.add_pages_moved(src, dst, n - self._moved_seen.get((src, dst), 0))
        self._moved_seen = dict(stats.moved)

    def _dispatch(self, events: list[SeqEvent]) -> None:
        now = time.perf_counter()
        m = self.metrics
        for ev in events:
            stream = self._streams.get(ev.request_id)
            if stream is None:
                continue
            if ev.error is not None:
                del self._streams[ev.request_id]
                log.error("%s: failed: %s", ev.request_id, ev.error)
                stream.queue.put_nowait(RequestFailed(f"request {ev.request_id} failed: {ev.error}"))
                continue
            if stream.first_token is None:
                stream.first_token = now
                m.observe_ttft(now - stream.arrived)
                m.add_prefix_hit_tokens(stream.seq.num_reused_tokens or 0)
            else:
                m.observe_inter_token(now - stream.last_token)
            stream.last_token = now
            stream.generated += len(ev.token_ids)
            m.add_generated_tokens(len(ev.token_ids))
            delta = stream.detok.add(ev.token_ids)
            reason = ev.finish_reason.value if ev.finish_reason is not None else None
            text = delta.text
            if delta.stop is not None and reason is None:
                self.scheduler.cancel(ev.request_id)  # a stop string ended it: free its blocks now
                reason = FinishReason.STOP.value
            elif reason is not None:
                text += stream.detok.finish().text
            if reason is not None:
                del self._streams[ev.request_id]
                m.observe_e2e(now - stream.arrived)
                self._log_done(stream, reason)
            reused = (stream.seq.num_reused_tokens or 0) if reason is not None else None
            stream.queue.put_nowait(Chunk(ev.token_ids, text, reason, ev.logprobs, reused))

    def _log_done(self, s: _Stream, reason: str) -> None:
        log.info("%s", request_line(s.request.request_id, len(s.request.prompt_token_ids),
                                    s.seq.num_reused_tokens or 0, s.arrived, s.first_token, s.generated,
                                    s.seq.draft_stats, reason))
        if self.engine.experts is not None:
            log.info("%s: %s", s.request.request_id, expert_line(*s.experts))
