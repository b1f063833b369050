"""A submitted request's stream: what the server reads (`RequestStream`, its `Chunk`s), and the event
loop's state of it (`StreamState`, the driver's: engine/driver.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radianced.engine.detokenizer import IncrementalDetokenizer
from radianced.engine.request import Request

if TYPE_CHECKING:
    from radianced.engine.driver import AsyncEngine


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
class StreamState:
    """The loop's view of one live request."""

    request: Request
    detok: IncrementalDetokenizer
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    generated: int = 0
    seq: object = None  # the scheduler's Sequence, once the step thread has added the request (read-only here)
    experts: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # decode (lookups, hits, routed, missed routed)


class RequestStream:
    """One submitted request's chunks, in order; the last has a finish_reason.

    `close()` (or `aclose()`) before the last chunk cancels the request; after
    it, or twice, it does nothing. Raises EngineFailed if the engine task dies.
    `ready()` takes the chunks already queued without waiting, so a reader that fell
    behind the steps sends them in one write (vLLM's output collector merges them too).
    """

    def __init__(self, engine: AsyncEngine, stream: StreamState):
        self._engine = engine
        self._stream = stream
        self._failure: BaseException | None = None  # met by `ready()`, raised by the next `__anext__`
        self.done = False

    @property
    def request_id(self) -> str:
        return self._stream.request.request_id

    @property
    def num_reused_tokens(self) -> int:
        """Prompt tokens the prefix cache served (0 until the request is admitted)."""
        return reused_tokens(self._stream)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Chunk:
        if self.done:
            raise StopAsyncIteration
        if self._failure is not None:  # met by `ready()` after the chunks it returned
            chunk, self._failure = self._failure, None
        else:
            chunk = await self._stream.queue.get()
        if isinstance(chunk, RequestFailed):
            self.done = True
            raise chunk
        if isinstance(chunk, BaseException):
            self.done = True
            raise EngineFailed(f"the engine failed: {chunk!r}") from chunk
        self.done = chunk.finish_reason is not None
        return chunk

    def ready(self) -> list[Chunk]:
        """The chunks queued now, in order, up to the last one or a failure (kept for `__anext__` to raise)."""
        out: list[Chunk] = []
        while not self.done and self._failure is None and not self._stream.queue.empty():
            item = self._stream.queue.get_nowait()
            if isinstance(item, BaseException):
                self._failure = item
            else:
                out.append(item)
                self.done = item.finish_reason is not None
        return out

    def close(self) -> None:
        if not self.done:
            self.done = True
            self._engine.cancel(self.request_id)

    async def aclose(self) -> None:
        self.close()


def reused_tokens(stream: StreamState) -> int:
    """Prompt tokens the prefix cache served the stream's request (0 before it is added)."""
    return (stream.seq.num_reused_tokens or 0) if stream.seq is not None else 0
