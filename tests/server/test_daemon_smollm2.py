"""The daemon with no --model: the bundled SmolLM2-135M-Instruct, answering through the openai SDK."""

from __future__ import annotations

import openai
import pytest

from radianced.model.default import ensure_default_model
from tests.server.conftest import start_daemon


@pytest.fixture(scope="module")
def smollm2_daemon():
    try:
        ensure_default_model()  # what `make run` prepares; the daemon finds it in the same cache
    except FileNotFoundError as e:
        pytest.skip(str(e))
    d = start_daemon(None, "--card-mib", "2048", "--max-model-len", "512")
    yield d
    assert d.stop() == 0


def test_the_default_model_is_served_under_its_name_and_answers_paris(smollm2_daemon):
    api = openai.OpenAI(base_url=f"{smollm2_daemon.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in api.models.list().data] == ["smollm2-135m-instruct"]
    r = api.chat.completions.create(model="smollm2-135m-instruct", temperature=0, max_tokens=32,
                                    messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 8  # seven tokens and <|im_end|>
