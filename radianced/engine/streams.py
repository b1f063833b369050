"""A submitted request's stream: what the server reads (`RequestStream`, its `Chunk`s), and the event
loop's state of it (`StreamState`, the driver's: engine/driver.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from radianced.engine.detokenizer import IncrementalDetokenizer
from radianced.engine.request import Request


class EngineFailed(RuntimeError):
    """The request cannot go on: the engine task died (no live request will get another
    token), or, as `RequestFailed`, a step could not compute this request."""


class RequestFailed(EngineFailed):
    """This request failed (an expert it routed to could not be read); the engine and the
    other requests go on. The message says what failed and what to do."""


class Chunk(msgspec.Struct, frozen=True, array_like=True):  # a struct: the HTTP front's frames carry it
    """What one step produced for a request: new token ids, the text they settle,
    and, on the last chunk, why the request ended."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: Any = None  # (the chosen token's logprob, [(id, logprob)] of the top-N)
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
class StreamState:
    """The loop's view of one live request."""

    request: Request
    detok: IncrementalDetokenizer
    deliver: Callable[[Chunk | BaseException], None]  # each chunk in order, then at most one failure
    arrived: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    generated: int = 0
    seq: object = None  # the scheduler's Sequence, once the step thread has added the request (read-only here)
    experts: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # decode (lookups, hits, routed, missed routed)


class RequestStream:
    """One submitted request's chunks, in order; the last has a finish_reason.

    `close()` (or `aclose()`) before the last chunk cancels the request (`cancel(request_id)`); after
    it, or twice, it does nothing. Raises EngineFailed if the engine task dies, RequestFailed if a step
    could not compute the request. `ready()` takes the chunks already queued without waiting, so a
    reader that fell behind the steps sends them in one write (vLLM's output collector merges them
    too). In the engine's process the engine fills the queue (`AsyncEngine.submit`); in the HTTP front
    the chunks the daemon sent do (server/engine_client.py): the same chunks either way.
    """

    def __init__(self, request_id: str, queue: asyncio.Queue, cancel: Callable[[str], object]):
        self.request_id = request_id
        self._queue = queue
        self._cancel = cancel
        self._failure: BaseException | None = None  # met by `ready()`, raised by the next `__anext__`
        self.num_reused_tokens = 0  # prompt tokens the prefix cache served: known with the last chunk
        self.done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Chunk:
        if self.done:
            raise StopAsyncIteration
        if self._failure is not None:  # met by `ready()` after the chunks it returned
            chunk, self._failure = self._failure, None
        else:
            chunk = await self._queue.get()
        if isinstance(chunk, EngineFailed):  # RequestFailed, or the HTTP front's copy of either
            self.done = True
            raise chunk
        if isinstance(chunk, BaseException):
            self.done = True
            raise EngineFailed(f"the engine failed: {chunk!r}") from chunk
        self._took(chunk)
        return chunk

    def ready(self) -> list[Chunk]:
        """The chunks queued now, in order, up to the last one or a failure (kept for `__anext__` to raise)."""
        out: list[Chunk] = []
        while not self.done and self._failure is None and not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, BaseException):
                self._failure = item
            else:
                out.append(item)
                self._took(item)
        return out

    def _took(self, chunk: Chunk) -> None:
        self.done = chunk.finish_reason is not None
        if chunk.reused_tokens is not None:
            self.num_reused_tokens = chunk.reused_tokens

    def close(self) -> None:
        if not self.done:
            self.done = True
            self._cancel(self.request_id)

    async def aclose(self) -> None:
        self.close()


def reused_tokens(stream: StreamState) -> int:
    """Prompt tokens the prefix cache served the stream's request (0 before it is added)."""
    return (stream.seq.num_reused_tokens or 0) if stream.seq is not None else 0
