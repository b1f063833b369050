"""The limits on one request's input (server/limits.py) and the decode failures (body_decoding.py), at the
parser: each past-the-limit request is a 400 naming the field and the limit (issue 19, findings 1, 2, 3
and 9); `prepare` checks a prompt's bytes before it tokenizes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from radianced.model.tiny import make_tiny
from radianced.model.tokenizer import Tokenizer
from radianced.server.api_errors import ProtocolError
from radianced.server.api_requests import parse_chat, parse_completion
from radianced.server.limits import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, max_prompt_bytes
from radianced.server.prompts import prepare
from radianced.server.state import Served

USER = [{"role": "user", "content": "hi"}]
DEEP_JSON = ("the request body nests JSON arrays or objects too deeply to decode (the limit is the interpreter's "
             "recursion depth, a thousand levels or more; a request needs a handful)")


def refusal(fn, data: bytes, *args, **kw) -> tuple[int, str | None, str]:
    with pytest.raises(ProtocolError) as e:
        fn(data, *args, **kw)
    return e.value.status, e.value.param, e.value.message


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_the_limits_are_what_the_readme_says():
    assert (MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS) == (16, 512, 1024)
    assert max_prompt_bytes(256, 13) == 3328


@pytest.mark.parametrize("parse, fields", [(parse_completion, {"prompt": "x"}), (parse_chat, {"messages": USER})])
def test_stop_strings_and_stop_ids_past_the_limits_are_400s(parse, fields):
    at_limit = ["y" * MAX_STOP_CHARS] * MAX_STOP_STRINGS
    assert parse(body(**fields, stop=at_limit, stop_token_ids=[1] * MAX_STOP_TOKEN_IDS)).params.stop == \
        tuple(at_limit)
    assert refusal(parse, body(**fields, stop=["y" * 1_000_000])) == (
        400, "stop", "stop[0] is 1000000 characters long; a stop string may have at most 512")
    assert refusal(parse, body(**fields, stop="y" * 513)) == (
        400, "stop", "stop is 513 characters long; a stop string may have at most 512")
    assert refusal(parse, body(**fields, stop=["a"] * 17)) == (
        400, "stop", "stop has 17 strings; at most 16 are allowed")
    assert refusal(parse, body(**fields, stop_token_ids=[1] * 1025)) == (
        400, "stop_token_ids", "stop_token_ids has 1025 ids; at most 1024 are allowed")


@pytest.mark.parametrize("parse, fields", [(parse_completion, {"prompt": "x"}), (parse_chat, {"messages": USER})])
def test_a_stop_token_id_outside_the_vocabulary_is_a_400(parse, fields):
    assert parse(body(**fields, stop_token_ids=[0, 99]), vocab_size=100).params.stop_token_ids == (0, 99)
    for bad in (100, 2**70):  # 2**70: past what the frames to the engine's process carry, too
        assert refusal(parse, body(**fields, stop_token_ids=[1, bad]), vocab_size=100) == (
            400, "stop_token_ids", f"stop_token_ids holds {bad}: a token id is in 0..99")


@pytest.mark.parametrize("parse, fields", [(parse_completion, {"prompt": "x"}), (parse_chat, {"messages": USER})])
def test_top_k_past_the_vocabulary_is_a_400(parse, fields):
    assert parse(body(**fields, top_k=100), vocab_size=100).params.top_k == 100
    assert refusal(parse, body(**fields, top_k=2**63), vocab_size=100) == (
        400, "top_k", f"top_k must be at most the vocabulary size (100), or 0 / -1 to disable it, got {2**63}")


def test_null_content_is_blamed_on_the_message_not_the_template():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": None}]
    assert refusal(parse_chat, body(messages=messages)) == (
        400, "messages[1].content", "messages[1].content is required (a string or a list of text parts); null goes "
        "only beside tool_calls, which are not supported")
    assert refusal(parse_chat, body(messages=[{"role": "user"}]))[1] == "messages[0].content"


@pytest.mark.parametrize("escape", ["\\ud800", "\\udfff", "\\ud83d"])
def test_a_lone_surrogate_is_named_not_called_truncated(escape):
    data = b'{"prompt": "x", "stop": ["' + escape.encode() + b'"]}'
    assert refusal(parse_completion, data) == (
        400, None, f"the request body is not valid JSON (a string holds the lone UTF-16 surrogate {escape} at byte "
        f"26, which is not a character; write the character itself, or a high and low surrogate pair)")
    pair = b'{"prompt": "x", "stop": ["\\ud83d\\ude00"]}'
    assert parse_completion(pair).params.stop == ("\U0001f600",)
    assert parse_completion(b'{"prompt": "a\\u0000b"}').request.prompt == "a\x00b"  # NUL is a character


@pytest.mark.parametrize("depth", [20_000, 100_000])  # past the limit of Python 3.11 (1,000) and 3.12 (C's, more)
def test_deep_json_is_a_400_on_both_endpoints(depth):
    nest = b"[" * depth + b"]" * depth
    assert refusal(parse_completion, b'{"x": ' * depth + b"1" + b"}" * depth) == (400, None, DEEP_JSON)
    assert refusal(parse_completion, b'{"prompt": "x", "unknown": ' + nest + b"}") == (400, None, DEEP_JSON)
    assert refusal(parse_chat, b'{"messages": [], "chat_template_kwargs": {"a": ' + nest + b"}}") == \
        (400, None, DEEP_JSON)


def test_template_kwargs_deeper_than_the_limit_are_a_400():
    ok = {"a": json.loads("[" * 32 + "]" * 32)}
    assert parse_chat(body(messages=USER, chat_template_kwargs=ok)).request.chat_template_kwargs == ok
    deep = {"a": json.loads("[" * 33 + "]" * 33)}
    assert refusal(parse_chat, body(messages=USER, chat_template_kwargs=deep)) == (
        400, "chat_template_kwargs", "chat_template_kwargs nests more than 32 levels deep")


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    """The tiny llama's tokenizer behind a 256-token context (no engine: `prepare` reads only its tokenizer)."""
    tok = Tokenizer((make_tiny("llama", tmp_path_factory.mktemp("tiny")) / "tokenizer.json").read_text(),
                    "{% for m in messages %}{{ m['content'] }}{% endfor %}", None, ())
    return Served(SimpleNamespace(tokenizer=tok), "tiny", 256, {}, tok.vocab_size)


def test_a_prompt_past_what_the_context_could_hold_is_refused_before_tokenizing(served, monkeypatch):
    tok = served.engine.tokenizer
    limit = 256 * tok.max_token_bytes
    assert tok.max_token_bytes == 13  # "<|endoftext|>"
    monkeypatch.setattr(tok, "encode", lambda *a, **k: pytest.fail("tokenized a prompt that cannot fit"))
    message = (f"the prompt is {limit + 1} bytes: more than the 256 tokens of the context length (--max-model-len) "
               f"can hold, at most 13 bytes a token of this model ({limit} bytes); shorten the prompt")
    assert refusal(prepare, served, body(prompt="é" + "x" * (limit - 1)), False) == (400, "prompt", message)
    half = "é" * (limit // 4)
    assert refusal(prepare, served, body(messages=[{"role": "user", "content": half}] * 2 + USER), True) == (
        400, "messages", message.replace(f"is {limit + 1} bytes", f"is {limit + 2} bytes"))


def test_a_prompt_under_the_byte_limit_is_tokenized_and_fitted(served):
    ready = prepare(served, body(prompt="hello " * 10, max_tokens=3), False)
    assert ready.prompt_ids == served.engine.tokenizer.encode("hello " * 10, add_special_tokens=True)
    assert ready.params.max_tokens == 3
    n = len(served.engine.tokenizer.encode("hello " * 500, add_special_tokens=True))
    assert refusal(prepare, served, body(prompt="hello " * 500), False) == (
        400, "prompt", f"the prompt is {n} tokens and the context length (--max-model-len) is 256: no room for a "
        f"single token; shorten the prompt")
