"""The runner reuses a decode batch's sampling tensors across steps, and only where that is exact.

Decode steps of one batch carry the same requests' params; building and copying the
[B] tensors again each step is host time the GPU waits for at batch 1. The cache must
still give each step its own seeds (they follow the output length), and rebuild when
the rows' params change or when penalties read the token histories.
"""

from __future__ import annotations

import torch

from radianced.engine.sampler import SamplingRow, SamplingTensors, seeded_rows
from radianced.engine.sampling_params import SamplingParams
from tests.engine.conftest import small_engine, tiny_rads  # noqa: F401 (fixture)


def test_same_params_reuse_the_tensors_with_this_steps_seeds(tiny_rads):  # noqa: F811
    runner = small_engine(tiny_rads["llama"]).runner
    seeded, greedy = SamplingParams(temperature=0.8, top_p=0.9, seed=7), SamplingParams(temperature=0.0)
    first = runner._sampling_tensors([SamplingRow(seeded, [1, 2]), SamplingRow(greedy, [3])])
    rows = [SamplingRow(seeded, [1, 2, 5]), SamplingRow(greedy, [3, 4])]
    second = runner._sampling_tensors(rows)
    assert second.temperature is first.temperature and second.top_k is first.top_k
    assert second.seeded == seeded_rows(rows) != first.seeded  # the seed of output token 3, not 2
    fresh = SamplingTensors.build(rows, runner.vocab_size)
    for name in ("temperature", "greedy", "top_k", "top_p", "min_p"):
        assert torch.equal(getattr(second, name), getattr(fresh, name)), name


def test_other_params_or_penalties_rebuild(tiny_rads):  # noqa: F811
    runner = small_engine(tiny_rads["llama"]).runner
    a, b = SamplingParams(temperature=0.5), SamplingParams(temperature=0.5)  # equal, not the same request
    first = runner._sampling_tensors([SamplingRow(a, [1])])
    assert runner._sampling_tensors([SamplingRow(b, [1, 2])]).temperature is not first.temperature
    assert runner._sampling_tensors([SamplingRow(a, [1]), SamplingRow(b, [1])]).temperature.shape == (2,)
    penalized = SamplingParams(temperature=0.5, frequency_penalty=0.5)
    one = runner._sampling_tensors([SamplingRow(penalized, [1])])
    two = runner._sampling_tensors([SamplingRow(penalized, [1, 1])])
    assert two.output_counts is not one.output_counts and float(two.output_counts[0, 1]) == 2.0
