"""Speculative decoding on the GPU: verify steps in the continuous batch, as the daemon builds the engine.

- Greedy tokens equal decoding without drafts on the tiny families (decode graphs on for plain
  steps, verify steps eager), with forced drafts replayed from that run: all right, every other
  step one right, all wrong; Qwen3-Next with its MTP head as the drafter too.
- The verify step's time against a plain step, per acceptance case, is recorded (the issue's
  forced-draft measurement), with the decode graphs' plain step as the baseline.

With RADIANCED_GPU_TEST_DEVICE=cpu this is a dry run of the test code (the CPU backend).
"""

from __future__ import annotations

import gc
import time

import pytest

from radianced.card import Card
from radianced.config import Config
from radianced.engine.engine import Engine
from radianced.engine.request import Request
from radianced.engine.sampling_params import SamplingParams
from radianced.engine.speculation import DraftPolicy, mtp_drafts
from radianced.model.convert import convert
from radianced.model.rad import RadFile
from radianced.model.tiny import make_tiny
from tests.engine.conftest import prompts, tiny_rads  # noqa: F401 (fixture)
from tests.gpu.conftest import gpu_device, record
from tools.bench_spec import Replay

TOKENS = 48


def _engine(rad: RadFile, speculative: int) -> Engine:
    device = gpu_device()
    cfg = Config(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=256, speculative=speculative,
                 deterministic=True)
    return Engine.build(rad, cfg, Card.from_mib(2048, cuda=device == "cuda"), device)


def _run(engine: Engine, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens of one request and the wall time of each step after its prefill."""
    engine.add(Request("r0", tuple(prompt), SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)))
    out, times = [], []
    while engine.scheduler.has_unfinished:
        t0 = time.perf_counter()
        out += [t for ev in engine.step() for t in ev.token_ids]
        times.append(time.perf_counter() - t0)
    return out, times[1:]


def _release(engine: Engine) -> None:
    engine.close()
    del engine
    gc.collect()  # the arena goes back before the next build reads the card


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "qwen3_next"])
def test_forced_drafts_give_the_plain_tokens_and_their_step_times_are_recorded(tiny_rads, family):  # noqa: F811
    rad = tiny_rads[family]
    prompt = prompts(rad.model.vocab_size, [40], seed=7)[0]
    plain = _engine(rad, 0)
    base, plain_times = _run(plain, prompt)
    _release(plain)
    rows = {"plain_ms": 1e3 * sorted(plain_times)[len(plain_times) // 2]}
    for wrong in ("none", "half", "all"):
        engine = _engine(rad, 4)
        replay = Replay(tuple(prompt), base, wrong, rad.model.vocab_size)
        engine.scheduler.drafting.policy = DraftPolicy(4, 0.0, adaptive=False, propose=replay)
        out, times = _run(engine, prompt)
        _release(engine)
        assert out == base, wrong
        rows[f"verify_{wrong}_ms"] = 1e3 * sorted(times)[len(times) // 2]
        rows[f"verify_{wrong}_steps"] = len(times) + 1
    record({"test": "speculative_forced_drafts", "family": family, "drafts": 4, **rows})


def test_the_mtp_head_drafts_on_the_device_and_the_tokens_are_the_plain_ones(tmp_path):
    src = make_tiny("qwen3_next", tmp_path, mtp_layers=1)
    convert(src, src / "model.rad")
    rad = RadFile.open(src / "model.rad")
    prompt = prompts(rad.model.vocab_size, [40], seed=8)[0]
    plain = _engine(rad, 0)
    base, _ = _run(plain, prompt)
    _release(plain)
    engine = _engine(rad, 2)
    assert engine.runner.model.mtp is not None and engine.runner.graphs is None
    engine.scheduler.drafting.policy = DraftPolicy(2, 0.0, adaptive=False, propose=mtp_drafts)
    out, times = _run(engine, prompt)
    _release(engine)
    assert out == base
    record({"test": "speculative_mtp", "step_ms": 1e3 * sorted(times)[len(times) // 2], "steps": len(times) + 1})
