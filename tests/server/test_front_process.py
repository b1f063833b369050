"""The daemon's end of the HTTP front (server/front_process.Front) against the front's engine client
(server/engine_client.EngineClient), over a real socket pair in this process, with the tiny llama's
engine: a request's chunks are the engine's own; a full queue is a 429; a stream left early cancels
its request; the phase, the requests in flight and /metrics cross; either end going away fails what
waits on the other, and nothing hangs."""

from __future__ import annotations

import asyncio
import re

import pytest

from radianced.card import Card
from radianced.config import Config
from radianced.engine.driver import AsyncEngine
from radianced.engine.engine import Engine
from radianced.engine.sampling_params import SamplingParams
from radianced.engine.streams import EngineFailed
from radianced.model.rad import RadFile
from radianced.server.api_errors import ProtocolError
from radianced.server.engine_client import GONE
from radianced.server.metrics import Metrics
from radianced.server.state import Phase
from tests.server.conftest import CARD_MIB, MAX_MODEL_LEN
from tests.server.front_pair import front_pair
from tests.server.test_http import PROMPT_IDS

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture
async def engine(tiny_model):
    rad = RadFile.open(tiny_model)
    cfg = Config(card_mib=CARD_MIB, max_model_len=MAX_MODEL_LEN, max_num_seqs=1, max_queue=1)
    ae = AsyncEngine(Engine.build(rad, cfg, Card.from_mib(CARD_MIB)), Metrics())
    yield ae
    rad.close()


@pytest.fixture
async def running(engine):
    task = asyncio.create_task(engine.run())
    yield engine
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_request_through_the_pair_streams_the_engines_own_chunks(running):
    front, client = await front_pair(running, running.metrics, max_model_len=MAX_MODEL_LEN)
    here = [c async for c in running.generate(PROMPT_IDS, GREEDY)]
    stream = await client.submit(PROMPT_IDS, GREEDY, "r1", 0.0, 0.0, 0.0)
    there = [c async for c in stream]
    assert [c.token_ids for c in there if c.token_ids] and \
        [t for c in there for t in c.token_ids] == [t for c in here for t in c.token_ids]
    assert "".join(c.text for c in there) == "".join(c.text for c in here)
    assert there[-1].finish_reason == "length" and stream.num_reused_tokens == there[-1].reused_tokens is not None
    assert client.tokenizer.decode(PROMPT_IDS) == running.tokenizer.decode(PROMPT_IDS)
    assert client.state.served.max_model_len == MAX_MODEL_LEN and running.num_live == 0


async def test_a_full_queue_is_a_429_with_the_schedulers_words_and_nothing_is_left_behind(engine):
    _, client = await front_pair(engine, engine.metrics)  # the engine does not run: the requests stay queued
    streams = [await client.submit(PROMPT_IDS, GREEDY, f"r{i}", 0.0, 0.0, 0.0) for i in range(2)]
    with pytest.raises(ProtocolError) as refused:
        await client.submit(PROMPT_IDS, GREEDY, "r2", 0.0, 0.0, 0.0)
    assert refused.value.status == 429 and "--max-queue 1" in str(refused.value)
    assert engine.num_live == 2 and "r2" not in client._queues and not client._pending
    for s in streams:
        s.close()
    await asyncio.sleep(0.05)
    assert engine.num_live == 0


async def test_a_stream_left_early_cancels_its_request_in_the_engine(running):
    _, client = await front_pair(running, running.metrics)
    stream = await client.submit(PROMPT_IDS, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), "long",
                                 0.0, 0.0, 0.0)
    first = await stream.__anext__()
    assert first.finish_reason is None
    await stream.aclose()
    for _ in range(100):
        if running.num_live == 0:
            break
        await asyncio.sleep(0.01)
    assert running.num_live == 0 and "long" not in client._queues


async def test_phase_requests_in_flight_and_metrics_cross_the_pair(running):
    front, client = await front_pair(running, running.metrics)
    await front.set_phase(Phase.READY, None)
    assert client.state.phase is Phase.READY and client.state.warm_up_token is None
    await front.set_phase(Phase.LOADING, "token")
    assert client.state.warm_up_token == "token"
    client.state.enter()
    client.state.enter()
    client.state.leave()
    await front.set_phase(Phase.READY)  # its Ack says how many are in flight
    idle = asyncio.create_task(front.wait_idle())
    await asyncio.sleep(0.02)
    assert front.in_flight == 1 and not idle.done()
    client.state.leave()
    await asyncio.wait_for(idle, 1)
    assert await client.answers(1.0)
    client.request_done(429)
    body, content_type = await client.metrics()
    assert content_type.startswith("text/plain")
    assert 'radiance_requests_total{status="429"} 1.0' in body.decode()
    assert "radiance_sequences_running 0.0" in body.decode()


async def test_the_daemons_end_closing_fails_every_wait_on_the_front(engine):
    front, client = await front_pair(engine, engine.metrics)
    stream = await client.submit(PROMPT_IDS, GREEDY, "r1", 0.0, 0.0, 0.0)  # queued: the engine does not run
    front._conn.close()
    assert await asyncio.wait_for(client.exited, 1) is False  # not asked to exit
    with pytest.raises(EngineFailed, match=re.escape(GONE)):
        await stream.__anext__()
    for call in (client.submit(PROMPT_IDS, GREEDY, "r2", 0.0, 0.0, 0.0), client.metrics()):
        with pytest.raises(ProtocolError, match=re.escape(GONE)):
            await call


async def test_the_fronts_end_closing_is_said_once_and_frees_the_drain(engine):
    gone = []
    front, client = await front_pair(engine, engine.metrics, on_gone=gone.append)
    client.state.enter()
    assert await client.answers(1.0)  # a round trip: the daemon's end has taken what was sent before it
    idle = asyncio.create_task(front.wait_idle())
    await asyncio.sleep(0.02)
    assert not idle.done()
    client._conn.close()
    await asyncio.wait_for(idle, 1)
    await asyncio.wait_for(front.set_phase(Phase.DRAINING), 1)  # nobody to answer: it does not wait
    assert gone == ["the HTTP front process ended"]


async def test_a_bug_in_queueing_one_request_is_its_500_and_the_pair_serves_on(running, monkeypatch, caplog):
    _, client = await front_pair(running, running.metrics)
    real = running.submit_to

    def fails_once(*args, **kwargs):
        monkeypatch.setattr(running, "submit_to", real)
        raise ValueError("a bug")

    monkeypatch.setattr(running, "submit_to", fails_once)
    with pytest.raises(ProtocolError) as failed:
        await client.submit(PROMPT_IDS, GREEDY, "r1", 0.0, 0.0, 0.0)
    assert failed.value.status == 500 and "internal error (ValueError)" in str(failed.value)
    assert "r1: could not be queued" in caplog.text and not client._pending and not client._queues
    stream = await client.submit(PROMPT_IDS, GREEDY, "r2", 0.0, 0.0, 0.0)
    assert [c async for c in stream][-1].finish_reason == "length"


async def test_a_front_that_does_not_take_a_phase_is_taken_as_hung_and_not_waited_for_again(engine, monkeypatch):
    front, client = await front_pair(engine, engine.metrics)
    monkeypatch.setattr("radianced.server.front_process.PHASE_ACK_S", 0.2)
    monkeypatch.setattr(client, "_take", lambda frame: None)  # reads, answers nothing
    client._conn.on_frame = client._take
    t = asyncio.get_running_loop().time()
    await front.set_phase(Phase.READY)
    await front.set_phase(Phase.DRAINING)
    assert front._hung and front.phase is Phase.DRAINING and asyncio.get_running_loop().time() - t < 0.5
