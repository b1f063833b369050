"""Fuzzed request bodies for both endpoints: never a 5xx, never a dead daemon.

Bodies mix the fields the endpoints know (with plausible and absurd values),
unknown fields, any JSON and raw bytes. The daemon has a 64-token context, so
a body that happens to be valid generates only a few tokens.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import SMALL_NAME, client

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8)
small_ints = st.integers(-3, 30)
numbers = st.floats(-3, 3, allow_nan=False) | st.integers(-3, 3)
token_ids = st.lists(st.integers(-2, 420), min_size=0, max_size=12)
stops = st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3)

SHARED = {
    "model": st.just(SMALL_NAME) | st.text(max_size=6),
    "max_tokens": small_ints, "temperature": numbers, "top_p": numbers, "top_k": st.integers(-2, 1000),
    "min_p": numbers, "seed": st.integers(-(2**65), 2**65), "n": st.integers(0, 3), "stop": stops,
    "presence_penalty": numbers, "frequency_penalty": numbers, "repetition_penalty": numbers,
    "stop_token_ids": token_ids, "ignore_eos": st.booleans(),
    "logit_bias": st.dictionaries(st.text(max_size=3), numbers),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
}
COMPLETION = {**SHARED, "prompt": st.text(max_size=30) | token_ids | st.lists(token_ids, max_size=2),
              "logprobs": small_ints, "echo": st.booleans(), "best_of": st.integers(0, 2)}
content = st.text(max_size=30) | st.none() | st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"])}, optional={"text": st.text(max_size=10)}),
    max_size=2)
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "robot"])},
                                optional={"content": content, "name": st.text(max_size=5)})
CHAT = {**SHARED, "messages": st.lists(message, max_size=3), "max_completion_tokens": small_ints,
        "logprobs": st.booleans(), "top_logprobs": small_ints, "add_generation_prompt": st.booleans(),
        "chat_template_kwargs": st.dictionaries(st.sampled_from(["messages", "enable_thinking", "x"]), json_values,
                                                max_size=2),
        "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
        "tools": st.lists(json_values, max_size=1), "tool_choice": st.sampled_from(["none", "auto", "required"])}


# values a real client might send (so bodies reach the engine), per field
PLAUSIBLE = {
    "max_tokens": st.integers(1, 8), "max_completion_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 500),
    "min_p": st.floats(0, 1), "seed": st.integers(0, 2**64 - 1), "stop": stops.filter(bool),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "stop_token_ids": st.lists(st.integers(0, 399), max_size=3),
    "ignore_eos": st.booleans(), "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
    "stream": st.booleans(), "logprobs": st.integers(0, 20), "top_logprobs": st.integers(0, 20),
}
PLAUSIBLE_COMPLETION = {**PLAUSIBLE, "prompt": st.text(min_size=1, max_size=30) | st.lists(
    st.integers(0, 399), min_size=1, max_size=30)}
PLAUSIBLE_CHAT = {**PLAUSIBLE, "logprobs": st.booleans(), "messages": st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=30)}),
    min_size=1, max_size=3)}


def bodies(fields: dict, plausible: dict, required: str) -> st.SearchStrategy[bytes]:
    """Half plausible requests (the required field and a few others, in range), the rest
    field-aware objects where any field may hold any JSON, any JSON, or bytes."""
    optional = {k: v for k, v in plausible.items() if k != required}
    sane = st.fixed_dictionaries({required: plausible[required]}, optional=optional)
    valued = {k: v | json_values for k, v in fields.items()}
    wild = st.fixed_dictionaries({}, optional=valued).flatmap(
        lambda d: st.dictionaries(st.text(max_size=6), json_values, max_size=2).map(lambda extra: {**extra, **d}))
    encoded = st.one_of(sane, wild).map(lambda d: json.dumps(d).encode()).filter(lambda b: len(b) < 4096)
    return st.one_of(encoded, encoded, json_values.map(lambda v: json.dumps(v).encode()), st.binary(max_size=40))


FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])


def post_never_5xx(daemon, path: str, body: bytes) -> None:
    """POST `body` as JSON: no 5xx, no hang (a 30 s client timeout), a whole stream or an OpenAI
    error body."""
    with client(daemon, timeout=30) as c:
        r = c.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (body[:300], len(body), r.status_code, r.text[:500])
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n"), r.text
    elif r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@FUZZ
@given(body=bodies(COMPLETION, PLAUSIBLE_COMPLETION, "prompt"))
def test_fuzzed_completions_never_5xx(small_daemon, body):
    post_never_5xx(small_daemon, "/v1/completions", body)


@FUZZ
@given(body=bodies(CHAT, PLAUSIBLE_CHAT, "messages"))
def test_fuzzed_chat_completions_never_5xx(small_daemon, body):
    post_never_5xx(small_daemon, "/v1/chat/completions", body)


def test_the_daemon_survived_the_fuzz(small_daemon):
    with client(small_daemon) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "still here", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert "Traceback" not in small_daemon.log()
