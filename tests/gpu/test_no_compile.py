"""No kernel is built on the request path: the daemon warms every variant before ready (issue 18).

Each tiny family (bf16, so the Gated DeltaNet prefill runs fla-core's autotuned
kernels) is served by the daemon itself, a subprocess on the GPU; prompts of
random lengths (1 .. 4,000 tokens) come over HTTP one at a time and in bursts
of 8, greedy and sampled. /metrics' radiance_kernel_builds_total{phase="serving"}
must stay 0: it is counted from Triton's own compile hook and the autotuner
(kernels/compiles.py), so a variant the warm-up missed cannot hide.
"""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from radianced.model.convert import convert
from radianced.model.tiny import make_tiny
from tests.gpu.conftest import record
from tests.server.conftest import client, start_daemon

CONTEXT = 4096
BUILDS = re.compile(r'^radiance_kernel_builds_total\{([^}]*)\} (\S+)$', re.M)


def builds(d, phase: str) -> float:
    with client(d) as c:
        text = c.get("/metrics").text
    return sum(float(n) for labels, n in BUILDS.findall(text) if f'phase="{phase}"' in labels)


def complete(d, prompt: list[int], sampled: bool) -> int:
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0.8 if sampled else 0.0, "ignore_eos": True}
    if sampled:
        body.update(top_p=0.9, top_k=5, frequency_penalty=0.5, logprobs=2, seed=3)
    with client(d, timeout=300) as c:
        return c.post("/v1/completions", json=body).status_code


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "qwen3_next"])
def test_no_kernel_builds_while_serving(family, tmp_path):
    src = make_tiny(family, tmp_path / family)
    convert(src, src / "model.rad", dtype="bf16")
    d = start_daemon(src / "model.rad", "--max-model-len", str(CONTEXT), "--card-mib", "4096",
                     "--max-num-seqs", "8", "--max-num-batched-tokens", "2048", timeout_s=600)
    try:
        startup = builds(d, "start-up")
        assert startup > 0, "the compile hook saw nothing at start-up: is it installed?"
        assert "warm-up:" in d.log()
        rng = random.Random(family)
        vocab = 300  # ordinary ids of the tiny tokenizer
        lengths = [rng.randint(1, CONTEXT - 8) for _ in range(24)]
        for i, n in enumerate(lengths):
            assert complete(d, [rng.randrange(vocab) for _ in range(n)], sampled=i % 3 == 0) == 200
        with ThreadPoolExecutor(8) as pool:
            for burst in range(3):
                sizes = [rng.randint(1, 600) for _ in range(8)]
                codes = list(pool.map(lambda n: complete(d, [rng.randrange(vocab) for _ in range(n)],
                                                         sampled=n % 2 == 0), sizes))
                assert codes == [200] * 8
        serving = builds(d, "serving")
        record({"test": "no_compile", "family": family, "startup_builds": startup, "serving_builds": serving,
                "log": [ln for ln in d.log().splitlines() if "warm-up" in ln or "kernel " in ln][-12:]})
        assert serving == 0, "kernels built while serving:\n" + "\n".join(
            ln for ln in d.log().splitlines() if "while serving" in ln)
    finally:
        assert d.stop() == 0, d.log()[-3000:]
