"""The async driver: the engine's rounds on the step thread, the requests' streams on the event loop.

DESIGN.md "Threads and I/O" has the event loop own the HTTP work and the
streams and never call into torch; the HTTP work itself now runs in a process
of its own (server/front_process.py), so this loop keeps the streams and the
frames to and from it. The step thread runs the engine's one loop
(engine/engine.py: plan, execute, apply) on its own: each round's bookkeeping
runs beside the step on the device, and no round waits for the event loop
(only for the GIL, when the loop runs Python: tools/gil_stall.py).
Before, the loop planned and applied every round, so a round waited for
whatever the loop was doing: on the H200 a burst of 8 prompts of 2,000 tokens
(their HTTP bodies, admission, responses) held rounds 10-20 ms while every
step's device time was under 5 ms. The loop hands the thread its changes (a
request to add, one to cancel, a call to make between steps) through an inbox
the thread empties before each plan, and the thread hands each finished step's
events back with `call_soon_threadsafe`; the loop turns them into stream chunks.
A stop string is found there, by the request's detokenizer, so the step thread
may run a step or two more for that request before it takes the cancel; their
tokens are dropped.

The server's API: `submit()` queues a request at once (or raises `QueueFull`)
and returns its `RequestStream`; `submit_to()` gives its chunks to a callback
instead (the HTTP front's link); `generate()` is `submit` as one async iterator
that queues on its first `__anext__`. Either way, leaving the stream before its
last chunk cancels the request; its blocks are freed before the next step.
`between_steps(fn)` runs fn on the step thread between two rounds. If the
engine task dies, every live stream raises `EngineFailed`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from radianced.engine.detokenizer import IncrementalDetokenizer
from radianced.engine.engine import Engine, Executed
from radianced.engine.engine_metrics import EngineMetrics, NoMetrics
from radianced.engine.pacing import StepPacer
from radianced.engine.request import FinishReason, Request, SeqStatus
from radianced.engine.request_log import expert_line, request_line
from radianced.engine.sampling_params import SamplingParams
from radianced.engine.scheduler import SeqEvent
from radianced.engine.speculation import DraftStats
from radianced.engine.step_trace import StepTrace
from radianced.engine.streams import (
    Chunk, EngineFailed, LiveRequest, RequestFailed, RequestStream, StreamState, reused_tokens,
)
from radianced.handoff import call_into

log = logging.getLogger("radianced.requests")


def step_executor() -> ThreadPoolExecutor:
    """The thread an engine's steps run on."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="radianced-step")


class AsyncEngine:
    def __init__(self, engine: Engine, metrics: EngineMetrics | None = None, pacer: StepPacer | None = None,
                 step_thread: ThreadPoolExecutor | None = None, trace: StepTrace | None = None):
        """pacer: caps each step's tokens at a step time measured here (engine/pacing.py); None
        keeps the scheduler's --max-num-batched-tokens budget. step_thread: the one-worker executor
        the rounds run on (the daemon's, which ran the warm-up there: a thread's first steps pay its own
        set-up, torch's CPU thread team and cuBLAS handle among it); None: a new one. trace: the rounds'
        timeline (engine/step_trace.py), closed when `run` ends; None: none."""
        self.engine = engine
        self.pacer = pacer
        self.trace = trace or StepTrace.off()
        self.scheduler = engine.scheduler
        self.metrics = metrics or NoMetrics()
        self._streams: dict[str, StreamState] = {}  # the loop's: live requests by id
        self._worker = step_thread or step_executor()
        self._ids = itertools.count()
        self._failed: BaseException | None = None
        self._inbox: deque[Callable[[], None]] = deque()  # the loop's changes, for the step thread
        self._arriving = 0  # requests in the inbox, not yet added (under _lock)
        self._lock = threading.Lock()
        self._wake = threading.Event()  # set with each inbox entry: the step thread may be waiting
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.steps = 0  # completed steps: the watchdog's sign of progress
        self.restart_counts()

    def restart_counts(self) -> None:
        """Report the slab's and the arena's counts from here: what the start fill and the warm-up
        (engine/warmup.py: requests served before ready) did is not traffic. Between steps (the
        step thread's, or before `run`)."""
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
        return not self._streams

    async def run(self) -> None:
        """The engine task: the rounds run on the step thread until this task is cancelled (the thread
        ends after its round). If a round raises, every live stream raises EngineFailed and so does
        this task."""
        self._loop = asyncio.get_running_loop()
        rounds = self._loop.run_in_executor(self._worker, self._rounds)
        try:
            await asyncio.shield(rounds)
        except asyncio.CancelledError:
            self._closing = True
            self._wake.set()
            await asyncio.gather(rounds, return_exceptions=True)
            raise
        except BaseException as e:
            self._fail(e)
            raise
        finally:
            self._worker.shutdown(wait=True)
            self.trace.close()

    async def between_steps(self, fn: Callable[[], object]) -> object:
        """fn() on the step thread between two rounds (what reads or changes the engine's state:
        `Engine.expert_routing`, warm-up's `forget`); its result or exception."""
        if self._failed is not None:
            raise EngineFailed(f"the engine failed: {self._failed!r}")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._post(lambda: call_into(loop, done, fn))
        return await done

    # -- the step thread ------------------------------------------------------------------

    def _rounds(self) -> None:
        """The engine's rounds (engine/engine.py) until `run` is cancelled: the inbox taken, then
        plan, execute and apply; a finished step's events go to the loop."""
        engine, loop = self.engine, self._loop
        start = None  # when the step being finished began (its launch's round)
        while not self._closing:
            self._wake.clear()  # before the inbox is read: an entry posted after it sets it again
            t = time.perf_counter()
            taken = self._take_inbox()
            if (work := engine.plan()) is None:  # idle, or nothing fits until a request ends
                self._wake.wait()
                continue
            planned = time.perf_counter()
            start = start or planned
            done = engine.execute(work)
            if work.launch is not None:
                self.metrics.observe_launch(done.launch_s, done.launch_s - done.launch_cpu_s)
            events = engine.apply(done)
            if done.finished is not None:
                counts = self._count_step(done, time.perf_counter() - start)
                loop.call_soon_threadsafe(self._dispatch, events, counts, time.perf_counter())
                start = time.perf_counter() if done.launched is not None else None
            self.trace.round(t, taken, planned - t, work, done, time.perf_counter())
        self._take_inbox()  # what came with the cancel: `between_steps` callers are answered

    def _take_inbox(self) -> int:
        """Run the loop's changes posted so far; how many."""
        with self._lock:
            calls = list(self._inbox)
            self._inbox.clear()
        for call in calls:
            call()
        return len(calls)

    def _add(self, stream: StreamState) -> None:
        try:
            stream.seq = self.scheduler.add(stream.request)
        finally:
            with self._lock:
                self._arriving -= 1

    def _count_step(self, done: Executed, seconds: float) -> list[tuple[int, list[int]]]:
        """A finished step: its time (and the next step's budget), the tiers' counts; its
        sequences' expert counts (seq_id, counts), for their requests."""
        self.metrics.observe_step(seconds)
        plan, own = done.finished.plan, done.output.seconds  # the step's own time, not the round's
        d = plan.decodes
        kind = "decode" if d == len(plan.seqs) else "mixed" if d else "prefill"
        self.metrics.add_step_tokens(kind, plan.num_tokens)
        if own is not None:
            self.metrics.observe_step_kind(kind, own)
            if self.pacer is not None:
                decoding = sum(not s.is_prefilling for s in self.scheduler.running)
                self.scheduler.step_tokens = self.pacer.observe(plan.num_tokens, len(plan.seqs), own, decoding, d)
        for s, tokens in zip(plan.seqs, done.output.token_ids):
            if s.drafts:
                self.metrics.add_drafts(len(s.drafts), len(tokens) - 1)
        counts = self._count_experts(plan, done.output, kind)
        self._count_tiers()
        self.steps += 1
        return counts

    # -- the event loop -------------------------------------------------------------------

    def _post(self, call: Callable[[], None], arriving: bool = False) -> None:
        with self._lock:
            self._inbox.append(call)
            self._arriving += arriving
        self._wake.set()

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> RequestStream:
        """Queue a request now and return its stream. Raises QueueFull when --max-queue
        requests wait, EngineFailed when the engine task has died.

        The caller must iterate the stream to its last chunk or close it.
        """
        queue: asyncio.Queue = asyncio.Queue()
        request_id = self.submit_to(prompt_ids, params, queue.put_nowait, request_id)
        return RequestStream(request_id, queue, self.cancel)

    def submit_to(self, prompt_ids: list[int], params: SamplingParams,
                  deliver: Callable[[Chunk | BaseException], None], request_id: str | None = None) -> str:
        """`submit` without the stream: each chunk, then at most one failure (RequestFailed, or what
        failed the engine), goes to `deliver` on the loop as it comes (the HTTP front's link sends a
        step's chunks of every request at once: server/front_process.py); the last chunk has a
        finish_reason. The request's id; `cancel` ends it early."""
        if self._failed is not None:
            raise EngineFailed(f"the engine failed: {self._failed!r}")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already live")
        with self._lock:
            self.scheduler.check_room(self._arriving)
        request = Request(request_id, tuple(prompt_ids), params,
                          frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                              else frozenset(self.tokenizer.eos_token_ids)))
        stream = StreamState(request, IncrementalDetokenizer.for_request(self.tokenizer, params, prompt_ids), deliver)
        self._streams[request_id] = stream
        self.metrics.add_prompt_tokens(len(prompt_ids))
        self._post(lambda: self._add(stream), arriving=True)
        self.trace.submit(stream.arrived, request_id, len(prompt_ids))
        return request_id

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
        """End a live request now: its stream ends at once, its blocks are freed before the next
        step. False if it is not live."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return False
        self._post(lambda: self.scheduler.cancel(request_id))
        self._log_done(stream, FinishReason.ABORT.value)
        stream.deliver(Chunk((), stream.detok.finish().text, FinishReason.ABORT.value, None,
                                      reused_tokens(stream)))
        return True

    def cancel_all(self) -> int:
        """Cancel every live request (the end of a drain); returns how many."""
        return sum(self.cancel(request_id) for request_id in list(self._streams))

    def live(self) -> list[LiveRequest]:
        """The live requests, oldest first."""
        now = time.perf_counter()
        return [LiveRequest(s.request.request_id,
                            "running" if s.seq is not None and s.seq.status is not SeqStatus.WAITING else "waiting",
                            len(s.request.prompt_token_ids), s.generated, now - s.arrived)
                for s in self._streams.values()]

    def _fail(self, error: BaseException) -> None:
        self._failed = error
        for stream in self._streams.values():
            stream.deliver(error)
        self._streams.clear()

    def _count_experts(self, plan, output, kind: str) -> list[tuple[int, list[int]]]:
        """The slab's step totals (distinct experts of the whole step: what actually moved) to the
        metrics, under the step's kind; the step's per-sequence expert counts, returned for their requests."""
        slab = self.engine.experts
        if slab is not None:
            lookups, hits = slab.stats.total_lookups, slab.stats.total_hits
            dl, dh = lookups - self._slab_seen[0], hits - self._slab_seen[1]
            self._slab_seen = (lookups, hits)
            self.metrics.add_expert_lookups(kind, dl, dh, (dl - dh) * slab.extent_bytes)
        if output.expert_counts is None:
            return []
        return [(s.seq_id, counts) for s, counts in zip(plan.seqs, output.expert_counts) if counts is not None]

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

    def _dispatch(self, events: list[SeqEvent], expert_counts: list[tuple[int, list[int]]], posted: float) -> None:
        """A finished step's events (and its sequences' expert counts) into their streams; on the loop."""
        now = time.perf_counter()
        m = self.metrics
        m.observe_loop_wait(now - posted)  # how long the step's tokens waited for the event loop
        self.trace.dispatch(now, posted, len(events))
        if expert_counts:
            by_seq = {s.seq.seq_id: s for s in self._streams.values() if s.seq is not None}
            for seq_id, counts in expert_counts:
                if (stream := by_seq.get(seq_id)) is not None:
                    stream.experts = [a + b for a, b in zip(stream.experts, counts)]
        for ev in events:
            stream = self._streams.get(ev.request_id)
            if stream is None:  # cancelled, or ended by a stop string while this step ran
                continue
            if ev.error is not None:
                del self._streams[ev.request_id]
                log.error("%s: failed: %s", ev.request_id, ev.error)
                stream.deliver(RequestFailed(f"request {ev.request_id} failed: {ev.error}"))
                continue
            if stream.first_token is None:
                stream.first_token = now
                m.observe_ttft(now - stream.arrived)
                m.add_prefix_hit_tokens(reused_tokens(stream))
            else:
                m.observe_inter_token(now - stream.last_token)
            stream.last_token = now
            stream.generated += len(ev.token_ids)
            m.add_generated_tokens(len(ev.token_ids))
            delta = stream.detok.add(ev.token_ids)
            reason = ev.finish_reason.value if ev.finish_reason is not None else None
            text = delta.text
            if delta.stop is not None and reason is None:
                self._post(lambda rid=ev.request_id: self.scheduler.cancel(rid))  # a stop string ended it
                reason = FinishReason.STOP.value
            elif reason is not None:
                text += stream.detok.finish().text
            if reason is not None:
                del self._streams[ev.request_id]
                m.observe_e2e(now - stream.arrived)
                self._log_done(stream, reason)
            reused = reused_tokens(stream) if reason is not None else None
            stream.deliver(Chunk(ev.token_ids, text, reason, ev.logprobs, reused))

    def _log_done(self, s: StreamState, reason: str) -> None:
        drafts = s.seq.draft_stats if s.seq is not None else DraftStats()
        log.info("%s", request_line(s.request.request_id, len(s.request.prompt_token_ids), reused_tokens(s), s.arrived,
                                    s.first_token, s.generated, drafts, reason))
        if self.engine.experts is not None:
            log.info("%s: %s", s.request.request_id, expert_line(*s.experts))
