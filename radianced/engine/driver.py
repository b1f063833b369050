"""The async driver: `Engine.step()` on a worker thread, bookkeeping on the event loop.

DESIGN.md "Threads and I/O": the event loop owns the scheduler, the request
streams and the telemetry and never calls into torch; one worker thread runs
`runner.run(plan)`. Adds and cancels arriving while a step runs are applied by
the loop before the next plan. `generate()` is the API the server uses.
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
from radianced.engine.engine import Engine
from radianced.engine.request import FinishReason, Request
from radianced.engine.sampling_params import SamplingParams
from radianced.engine.scheduler import SeqEvent

log = logging.getLogger("radianced.requests")


@dataclass(frozen=True)
class Chunk:
    """What one step produced for a request: new token ids, the text they settle,
    and, on the last chunk, why the request ended."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: object = None
    reused_tokens: int | None = None  # on the last chunk: prompt tokens the prefix cache served


@dataclass
class _Stream:
    """The loop's view of one live request."""

    request: Request
    detok: IncrementalDetokenizer
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    generated: int = 0
    seq: object = None  # the scheduler's Sequence (read for reuse counts)


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.scheduler = engine.scheduler
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radianced-step")
        self._ids = itertools.count()
        self.steps = 0  # completed steps: the watchdog's sign of progress

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def run(self) -> None:
        """The engine task: plan, execute on the worker, apply, until cancelled."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                plan = self.scheduler.schedule() if self.scheduler.has_unfinished else None
                if plan is None or plan.is_empty:  # idle, or nothing fits until a request ends
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                output = await loop.run_in_executor(self._worker, self.engine.runner.run, plan)
                self._dispatch(self.scheduler.update(plan, output))
                self.steps += 1
        finally:
            self._worker.shutdown(wait=True)

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[Chunk]:
        """Stream a request's output. Raises QueueFull at once when the queue is full.

        Closing the iterator early (client gone) cancels the request and frees its
        blocks before the next step.
        """
        request_id = request_id or f"req-{next(self._ids)}"
        request = Request(request_id, tuple(prompt_ids), params,
                          frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                              else frozenset(self.tokenizer.eos_token_ids)))
        stream = _Stream(request, IncrementalDetokenizer.for_request(self.tokenizer, params, prompt_ids))
        stream.seq = self.scheduler.add(request)
        self._streams[request_id] = stream
        self._wake.set()
        done = False
        try:
            while not done:
                chunk = await stream.queue.get()
                done = chunk.finish_reason is not None
                yield chunk
        finally:
            if not done:
                self.cancel(request_id)

    def cancel(self, request_id: str) -> bool:
        """End a live request now (its blocks return at once). False if it is not live."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return False
        self.scheduler.cancel(request_id)
        self._log_done(stream, FinishReason.ABORT.value)
        stream.queue.put_nowait(Chunk((), stream.detok.finish().text, FinishReason.ABORT.value))
        return True

    def _dispatch(self, events: list[SeqEvent]) -> None:
        now = time.perf_counter()
        for ev in events:
            stream = self._streams.get(ev.request_id)
            if stream is None:
                continue
            if stream.first_token is None:
                stream.first_token = now
            stream.generated += len(ev.token_ids)
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
                self._log_done(stream, reason)
            reused = (stream.seq.num_reused_tokens or 0) if reason is not None else None
            stream.queue.put_nowait(Chunk(ev.token_ids, text, reason, ev.logprobs, reused))

    def _log_done(self, s: _Stream, reason: str) -> None:
        now = time.perf_counter()
        first = s.first_token or now
        reused = s.seq.num_reused_tokens or 0
        prompt = len(s.request.prompt_token_ids)
        decode_s = now - first
        rate = (s.generated - 1) / decode_s if s.generated > 1 and decode_s > 0 else 0.0
        log.info("%s: prompt %d tokens = %d reused + %d read in %.0f ms, %d generated in %.0f ms (%.1f tok/s), "
                 "drafts accepted 0/0 (0%%) [%s]", s.request.request_id, prompt, reused, prompt - reused,
                 (first - s.arrived) * 1e3, s.generated, decode_s * 1e3, rate, reason)
