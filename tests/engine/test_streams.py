"""engine/streams.py's RequestStream: chunks in order, `ready()` without waiting, failures where they fall;
and server/answers.py's SSE writes, one for the chunks queued while the response was writing."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from radianced.engine.streams import Chunk, EngineFailed, RequestFailed, RequestStream
from radianced.server.answers import Answer


class Engine:
    def __init__(self):
        self.cancelled = []

    def cancel(self, request_id):
        self.cancelled.append(request_id)


def stream_of(*items) -> tuple[RequestStream, Engine]:
    queue = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    engine = Engine()
    return RequestStream("r1", queue, engine.cancel), engine


def chunk(text: str, finish: str | None = None) -> Chunk:
    return Chunk((len(text),), text, finish)


async def test_ready_takes_what_is_queued_up_to_the_last_chunk():
    s, _ = stream_of(chunk("a"), chunk("b"), chunk("c", "stop"), chunk("never"))
    assert (await s.__anext__()).text == "a"
    assert [c.text for c in s.ready()] == ["b", "c"] and s.done
    assert s.ready() == [] and [c async for c in s] == []


async def test_ready_on_an_empty_queue_returns_nothing_and_the_next_chunk_still_comes():
    s, _ = stream_of()
    assert s.ready() == [] and not s.done
    s._queue.put_nowait(chunk("x", "length"))
    assert [c.text async for c in s] == ["x"]


async def test_a_failure_met_by_ready_is_raised_by_the_next_read_after_the_chunks_before_it():
    s, _ = stream_of(chunk("a"), chunk("b"), RequestFailed("expert 7 unreadable"), chunk("after"))
    assert (await s.__anext__()).text == "a"
    assert [c.text for c in s.ready()] == ["b"] and s.ready() == []
    with pytest.raises(RequestFailed, match="expert 7"):
        await s.__anext__()
    assert s.done


async def test_the_engine_dying_reads_as_engine_failed():
    s, _ = stream_of(chunk("a"), RuntimeError("step thread died"))
    assert (await s.__anext__()).text == "a" and s.ready() == []
    with pytest.raises(EngineFailed, match="the engine failed"):
        await s.__anext__()


def answer() -> Answer:
    served = SimpleNamespace(name="m", engine=SimpleNamespace(tokenizer=None))
    req = SimpleNamespace(include_usage=False, logprobs=None)
    return Answer(served, "cmpl-1", chat=False, req=req, prompt_tokens=3)


async def test_chunks_queued_while_the_response_wrote_go_out_in_one_write():
    s, _ = stream_of(chunk("one"))
    writes = []
    events = answer().events(s)
    writes.append(await events.__anext__())  # the reader kept up: one event
    for item in (chunk("two"), chunk(""), chunk("three"), chunk("four", "length")):  # it fell behind
        s._queue.put_nowait(item)
    writes += [w async for w in events]
    assert [w.count(b"data: ") for w in writes] == [1, 3, 1]  # the held-back empty chunk sends nothing
    assert b'"text":"two"' in writes[1] and b'"finish_reason":"length"' in writes[1]
    assert writes[-1] == b"data: [DONE]\n\n"


async def test_a_failure_after_queued_chunks_sends_them_then_the_error():
    s, _ = stream_of(chunk("a"), chunk("b"), RuntimeError("boom"))
    writes = [w async for w in answer().events(s)]
    assert writes[0].count(b"data: ") == 2 and b"the engine failed" in writes[1] and writes[-1] == b"data: [DONE]\n\n"


async def test_the_usage_chunk_follows_the_write_that_holds_the_finish_reason():
    a = answer()
    a.req.include_usage = True
    s, _ = stream_of(chunk("a"), chunk("b", "stop"))
    writes = [w async for w in a.events(s)]
    assert len(writes) == 3 and writes[0].count(b"data: ") == 2 and b'"finish_reason":"stop"' in writes[0]
    assert b'"usage"' in writes[1] and b'"completion_tokens":2' in writes[1] and writes[2] == b"data: [DONE]\n\n"
