"""The async driver: streaming text, stop strings, and cancellation from the client side."""

from __future__ import annotations

import asyncio
import time

import pytest

from radianced.engine.driver import AsyncEngine
from radianced.engine.sampling_params import SamplingParams
from tests.engine.conftest import prompts, small_engine


async def _collect(ae: AsyncEngine, prompt, params):
    chunks = [c async for c in ae.generate(prompt, params)]
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], chunks[-1].finish_reason


@pytest.fixture
def served(tiny_rads):
    """An AsyncEngine over the tiny llama with its engine task running."""

    async def start():
        ae = AsyncEngine(small_engine(tiny_rads["llama"]))
        return ae, asyncio.create_task(ae.run())

    return start


async def test_stop_string_cuts_the_text_exactly_where_it_starts(served, tiny_rads):
    ae, task = await served()
    prompt = prompts(tiny_rads["llama"].model.vocab_size, (20,), seed=11)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full, _, reason = await _collect(ae, prompt, greedy)
    assert reason == "length" and len(full) > 12
    stop = full[8:12]  # starts mid-output, likely spans tokens
    cut, _, reason = await _collect(ae, prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                               stop=[stop]))
    assert reason == "stop"
    assert cut == full[:full.index(stop)]
    await ae.between_steps(lambda: None)  # the cancel reaches the step thread before its next plan
    assert ae.scheduler.kv_util == 0.0
    task.cancel()


async def test_closing_the_stream_early_cancels_and_frees_every_block(served, tiny_rads):
    ae, task = await served()
    prompt = prompts(tiny_rads["llama"].model.vocab_size, (40,), seed=12)[0]
    stream = ae.generate(prompt, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    await stream.__anext__()
    await stream.__anext__()
    assert ae.scheduler.allocator.num_used > 0
    await stream.aclose()  # the client went away
    await ae.between_steps(lambda: None)  # the cancel reaches the step thread before its next plan
    assert ae.scheduler.allocator.num_used == 0 and not ae.scheduler.has_unfinished
    task.cancel()


async def test_concurrent_streams_each_get_their_own_tokens(served, tiny_rads):
    ae, task = await served()
    ps = prompts(tiny_rads["llama"].model.vocab_size, (5, 17, 31), seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    together = await asyncio.gather(*(_collect(ae, p, params) for p in ps))
    for p, (_, ids, _) in zip(ps, together):
        _, alone, _ = await _collect(ae, p, params)
        assert ids == alone
    task.cancel()


async def test_steps_go_on_while_the_event_loop_is_busy(served, tiny_rads):
    """The rounds run on the step thread: a loop held by other work (a burst's HTTP bodies, say) delays
    the streams, not the steps; the tokens made meanwhile arrive in order once it is free."""
    ae, task = await served()
    prompt = prompts(tiny_rads["llama"].model.vocab_size, (12,), seed=14)[0]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    _, alone, _ = await _collect(ae, prompt, params)
    stream = ae.generate(prompt, params)
    first = await stream.__anext__()
    before = ae.steps
    time.sleep(0.3)  # the event loop held: no await
    assert ae.steps - before >= 5
    rest = [c async for c in stream]
    assert [t for c in (first, *rest) for t in c.token_ids] == alone
    task.cancel()
