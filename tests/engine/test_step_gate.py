"""The step thread's turn at the GIL (engine/step_gate.py): the HTTP side waits while the step thread works,
never longer than the cap, and not at all where the gate is off (the CPU) or the step thread waits."""

from __future__ import annotations

import asyncio
import threading
import time

from radianced.engine.driver import AsyncEngine
from radianced.engine.sampling_params import SamplingParams
from radianced.engine.step_gate import StepGate
from tests.engine.conftest import prompts, small_engine


def test_an_idle_or_disabled_gate_never_waits():
    gate = StepGate(enabled=True, wait_s=5.0)
    t = time.perf_counter()
    assert gate.give_way() is False  # the step thread is not working
    off = StepGate(enabled=False, wait_s=5.0)
    off.work()
    assert off.busy and off.give_way() is False  # off: the CPU, where the step is the compute
    assert time.perf_counter() - t < 1.0


def test_giving_way_waits_until_the_step_thread_rests():
    gate = StepGate(enabled=True, wait_s=5.0)
    gate.work()
    rested = []

    def step_thread():
        time.sleep(0.05)  # the launch
        rested.append(time.perf_counter())
        gate.rest()

    worker = threading.Thread(target=step_thread)
    worker.start()
    assert gate.give_way() is True
    back = time.perf_counter()
    worker.join()
    assert rested and back >= rested[0] and back - rested[0] < 1.0  # let through when it rested, not at the cap


def test_giving_way_waits_no_longer_than_the_cap():
    gate = StepGate(enabled=True, wait_s=0.02)
    gate.work()  # and never rests
    t = time.perf_counter()
    assert gate.give_way() is True
    assert 0.02 <= time.perf_counter() - t < 1.0


def test_a_device_wait_is_the_others_turn_and_the_work_resumes_after_it():
    gate = StepGate(enabled=True)
    gate.work()
    with gate.device_wait():
        assert not gate.busy
    assert gate.busy
    try:
        with gate.device_wait():
            raise RuntimeError("the device failed")
    except RuntimeError:
        pass
    assert gate.busy  # the round goes on (and fails) as the step thread's work


class _Recording(StepGate):
    """A gate that notes which thread marked what."""

    def __init__(self):
        super().__init__(enabled=False)
        self.marks: list[tuple[str, str]] = []

    def work(self):
        self.marks.append(("work", threading.current_thread().name))
        super().work()

    def rest(self):
        self.marks.append(("rest", threading.current_thread().name))
        super().rest()


async def test_the_rounds_mark_the_gate_from_the_step_thread_and_leave_it_at_rest(tiny_rads):
    gate = _Recording()
    ae = AsyncEngine(small_engine(tiny_rads["llama"]), gate=gate)
    task = asyncio.create_task(ae.run())
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for prompt in prompts(tiny_rads["llama"].model.vocab_size, (12, 30), seed=5):
        assert len([c async for c in ae.generate(prompt, params)]) >= 1
    await asyncio.sleep(0.05)  # the step thread finds nothing more to do
    assert not gate.busy  # idle: the HTTP side does not wait for it
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert {name for _, name in gate.marks} == {"radianced-step_0"}
    kinds = [k for k, _ in gate.marks]
    assert kinds[0] == "work" and kinds[-1] == "rest" and kinds.count("work") >= 8  # a round each: 2 x 4 tokens
