"""The disk tier behind the HTTP API: a slow read does not stall the server, and a failed read
answers 500 naming the expert to the one request that needed it; the daemon serves on.

In process (the ASGI app over httpx's transport, the front's frames over a socket pair) so that the reader's fault hook
(`tiers.faults.Faults`) can be armed; the engine, scheduler and io_uring reads are the daemon's.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from radianced.engine.driver import AsyncEngine
from radianced.server.http import build_app
from radianced.server.metrics import Metrics
from radianced.server.state import Phase
from radianced.tiers.faults import Faults
from tests.engine.conftest import prompts, tiny_rads  # noqa: F401 (fixture)
from tests.engine.test_disk_tier import disk_engine
from tests.server.front_pair import front_pair

DELAY = 0.6  # seconds each delayed read waits in the kernel


async def test_health_answers_during_a_slow_read_and_a_failed_read_is_a_500(tiny_rads):  # noqa: F811
    rad = tiny_rads["qwen3_moe"]
    engine = disk_engine(rad, slots=0)  # every routed expert is read from the file in every step
    faults = Faults()
    engine.experts.loader.reader.faults = faults
    first = min(rad.model.moe_layers)
    metrics = Metrics()
    ae = AsyncEngine(engine, metrics)
    front, client = await front_pair(ae, metrics, "tiny", 256, rad.model.vocab_size)
    await front.set_phase(Phase.READY)
    state = client.state
    task = asyncio.create_task(ae.run())
    (prompt,) = prompts(rad.model.vocab_size, (24,), seed=5)  # 24 tokens route every expert of a layer
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state)),
                                     base_url="http://radianced", timeout=30) as c:
            for e in range(rad.model.num_experts):
                faults.delay(first, e, DELAY)
            answer = asyncio.create_task(c.post("/v1/completions", json=body))
            latencies = []
            t0 = time.perf_counter()
            while not answer.done():
                t = time.perf_counter()
                assert (await c.get("/health")).status_code == 200
                latencies.append(time.perf_counter() - t)
                await asyncio.sleep(0.01)
            r = await answer
            assert r.status_code == 200 and time.perf_counter() - t0 >= DELAY
            assert len(latencies) > 10 and max(latencies) < 0.05, latencies

            for e in range(rad.model.num_experts):
                faults.fail(first, e)
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 500
            message = r.json()["error"]["message"]
            assert f"expert (layer {first}, expert " in message and "read failed" in message
            faults.failures.clear()  # any still armed (not routed) would fail the next request too
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
