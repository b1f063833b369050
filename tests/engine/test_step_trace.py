"""The rounds' timeline (engine/step_trace.py): a real AsyncEngine over the tiny llama writes it, and what it
says agrees with what was served."""

from __future__ import annotations

import asyncio
import json

from radianced.engine.driver import AsyncEngine
from radianced.engine.sampling_params import SamplingParams
from radianced.engine.step_trace import StepTrace
from tests.engine.conftest import prompts, small_engine


async def _serve(ae: AsyncEngine, batch: list[list[int]], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(prompt):
        return sum([len(c.token_ids) async for c in ae.generate(prompt, params)])

    return list(await asyncio.gather(*(one(p) for p in batch)))


async def test_the_trace_has_every_arrival_round_and_dispatch_in_time_order(tiny_rads, tmp_path):
    path = tmp_path / "trace.jsonl"
    ae = AsyncEngine(small_engine(tiny_rads["llama"]), trace=StepTrace(str(path)))
    task = asyncio.create_task(ae.run())
    batch = prompts(tiny_rads["llama"].model.vocab_size, (30, 70, 5), seed=3)  # 70: two 48-token steps
    assert await _serve(ae, batch, 6) == [6, 6, 6]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert not ae.trace.on  # closed with the engine task

    rows = [json.loads(line) for line in path.read_text().splitlines()]
    by_kind = {k: [r for r in rows if r["k"] == k] for k in ("submit", "round", "dispatch")}
    assert len(rows) == sum(map(len, by_kind.values()))
    assert sorted(r["prompt"] for r in by_kind["submit"]) == [5, 30, 70]
    rounds = by_kind["round"]
    assert sum(r["inbox"] for r in rounds) >= 3  # the three adds (and the cancels of none: all ran out)
    launched = [r["launch"] for r in rounds if r["launch"] is not None]
    collected = [r["collect"] for r in rounds if r["collect"] is not None]
    assert launched == collected  # every step launched is collected, in order, with its shape
    assert sum(tokens for _, _, tokens in launched) == 30 + 70 + 5 + 3 * 5  # prompts, then 5 decodes each
    assert all(d <= s for s, d, _ in launched) and any(d == s for s, d, _ in launched)
    assert all(r["t"] <= r["t"] + r["plan_s"] <= r["end"] and r["launch_cpu_s"] >= 0 for r in rounds)
    assert all(a["end"] <= b["t"] for a, b in zip(rounds, rounds[1:]))  # one thread, one round at a time
    assert all(r["own_s"] > 0 for r in rounds if r["collect"] is not None)  # the CPU times every step
    # the step thread's runnable-but-waiting time and the process's CPU, from the second round on
    assert rounds[0]["runq_s"] is None and rounds[0]["proc_cpu_s"] is None
    assert all(r["runq_s"] >= 0 and r["proc_cpu_s"] >= 0 for r in rounds[1:])
    assert sum(r["proc_cpu_s"] for r in rounds[1:]) > 0
    # each collected step's events reach the loop once, after the step thread posted them
    assert len(by_kind["dispatch"]) == len(collected)
    assert all(d["posted"] <= d["t"] for d in by_kind["dispatch"])
    first = min(r["t"] for r in by_kind["submit"])
    assert all(r["t"] >= first for r in rounds)  # nothing to run before the first arrival


def test_a_trace_that_is_off_writes_nothing_and_costs_nothing(tmp_path):
    trace = StepTrace.off()
    assert not trace.on
    trace.submit(0.0, "r", 3)
    trace.dispatch(1.0, 0.5, 2)
    trace.close()
    assert list(tmp_path.iterdir()) == []


def test_a_trace_whose_writes_fail_turns_itself_off_and_fails_nothing(caplog):
    """/dev/full refuses every write (ENOSPC), as a full disk would: the trace says so once and stops."""
    trace = StepTrace("/dev/full")
    assert trace.on
    trace.submit(0.0, "r", 3)
    trace.dispatch(1.0, 0.5, 2)
    assert not trace.on
    assert [r.getMessage() for r in caplog.records].count(
        "RADIANCED_STEP_TRACE: the step trace stopped: [Errno 28] No space left on device") == 1
    trace.close()
