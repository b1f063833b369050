"""The OpenAI wire format: bodies -> SamplingParams with the model's defaults, 400s naming the field,
responses and SSE chunks in the shapes the openai SDK reads."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radianced.engine.sampling_params import InvalidSamplingParams, SamplingParams
from radianced.server.api_errors import ProtocolError, error_body
from radianced.server.api_requests import (
    BATCH_REFUSAL, ChatCompletionRequest, CompletionRequest, check_model, fit_to_context, generation_defaults,
    parse_chat, parse_completion,
)
from radianced.server.api_responses import (
    SSE_DONE, ChatLogprobs, chat_completion_chunk, chat_completion_response, chat_token_logprob, chat_usage_chunk,
    completion_chunk, completion_logprobs, completion_response, completion_usage_chunk, encode, model_list, sse,
    usage,
)

USER = [{"role": "user", "content": "hi"}]


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def chat(**fields) -> bytes:
    return body(messages=USER, **fields)


def refusal(fn, data: bytes, *args, **kw) -> tuple[int, str | None, str]:
    with pytest.raises(ProtocolError) as e:
        fn(data, *args, **kw)
    return e.value.status, e.value.param, e.value.message


# -- requests -> SamplingParams ---------------------------------------------


def test_completion_with_text_prompt_maps_every_sampling_field():
    req, params = parse_completion(body(
        model="m", prompt="Once", max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=3,
        stop="\n", stop_token_ids=[2, 5], presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
        logprobs=2, ignore_eos=True, include_stop_str_in_output=True, skip_special_tokens=False, n=1, user="u"))
    assert isinstance(req, CompletionRequest) and req.prompt == "Once" and req.model == "m"
    assert params == SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=3, stop=("\n",),
        stop_token_ids=(2, 5), presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
        logprobs=2, ignore_eos=True, include_stop_str_in_output=True, skip_special_tokens=False)


def test_completion_prompt_as_token_ids_and_batch_of_one_unwrapped():
    assert parse_completion(body(prompt=[1, 2, 3]), vocab_size=4).request.prompt == [1, 2, 3]
    assert parse_completion(body(prompt=["text"])).request.prompt == "text"
    assert parse_completion(body(prompt=[[7, 8]])).request.prompt == [7, 8]


def test_completion_batch_prompts_refused_with_one_prompt_per_request():
    assert refusal(parse_completion, body(prompt=["a", "b"])) == (400, "prompt", BATCH_REFUSAL)
    assert refusal(parse_completion, body(prompt=[[1], [2]])) == (400, "prompt", BATCH_REFUSAL)
    assert BATCH_REFUSAL == "batch prompts are not supported; send one prompt per request"


@pytest.mark.parametrize("prompt, message", [
    ("", "prompt must not be empty"),
    ([], "prompt must not be empty"),
    ([1, "a"], "prompt must be a string or a list of token ids, got 'a' at prompt[1]"),
    ([1, True], "prompt must be a string or a list of token ids, got True at prompt[1]"),
    ([0, -1], "token id -1 at prompt[1] is outside this model's vocabulary (0..99)"),
    ([100], "token id 100 at prompt[0] is outside this model's vocabulary (0..99)"),
])
def test_completion_bad_prompt_names_prompt(prompt, message):
    assert refusal(parse_completion, body(prompt=prompt), vocab_size=100) == (400, "prompt", message)


def test_chat_maps_messages_limits_and_logprobs():
    req, params = parse_chat(body(
        model="m", messages=[{"role": "system", "content": "be brief"},
                             {"role": "user", "content": [{"type": "text", "text": "a"},
                                                          {"type": "text", "text": "b"}]}],
        stream=True, stream_options={"include_usage": True}, max_tokens=9, max_completion_tokens=5,
        logprobs=True, top_logprobs=3, stop=["x", "y"], seed=1, chat_template_kwargs={"enable_thinking": False}))
    assert isinstance(req, ChatCompletionRequest) and req.stream and req.include_usage
    assert req.template_messages() == [{"role": "system", "content": "be brief", "name": None},
                                       {"role": "user", "content": "a\nb", "name": None}]
    assert req.chat_template_kwargs == {"enable_thinking": False}
    assert (params.max_tokens, params.logprobs, params.stop, params.seed) == (5, 3, ("x", "y"), 1)


def test_chat_logprobs_flag_alone_reports_the_chosen_token_only():
    assert parse_chat(chat(logprobs=True)).params.logprobs == 0
    assert parse_chat(chat()).params.logprobs is None
    assert not parse_chat(chat(stream=True)).request.include_usage


def test_model_generation_config_fills_what_the_request_leaves_out():
    defaults = generation_defaults({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 256,
                                    "do_sample": True, "bos_token_id": 1, "min_p": None})
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 256}
    params = parse_chat(chat(top_p=0.5), defaults).params
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.5, 20, 256)
    assert parse_chat(chat(temperature=0), defaults).params.greedy
    assert parse_completion(body(prompt="x")).params == SamplingParams()


def test_generation_config_values_samplingparams_refuses_are_dropped():
    assert generation_defaults({"top_p": 0, "temperature": "hot", "repetition_penalty": 1.2}) == \
        {"repetition_penalty": 1.2}


def sampling_refusal(**fields) -> str:
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(**fields)
    return str(e.value)


@pytest.mark.parametrize("fields, param, sampling", [
    ({"max_tokens": 0}, "max_tokens", {"max_tokens": 0}),
    ({"max_completion_tokens": -3}, "max_completion_tokens", {"max_tokens": -3}),
    ({"temperature": -1}, "temperature", {"temperature": -1.0}),  # msgspec reads a JSON int as a float
    ({"top_p": 1.5}, "top_p", {"top_p": 1.5}),
    ({"presence_penalty": 3}, "presence_penalty", {"presence_penalty": 3.0}),
    ({"seed": 2**64}, "seed", {"seed": 2**64}),
    ({"stop": ["ok", ""]}, "stop", {"stop": ("ok", "")}),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", {"logprobs": 21}),
])
def test_out_of_range_sampling_value_is_a_400_naming_the_request_field(fields, param, sampling):
    """SamplingParams' message, with the field renamed to the one the request used."""
    field = next(iter(sampling))
    message = param + sampling_refusal(**sampling)[len(field):]
    assert message.startswith(f"{param} must be ") and message.endswith(f"got {next(iter(sampling.values()))!r}")
    assert refusal(parse_chat, chat(**fields)) == (400, param, message)


@pytest.mark.parametrize("fields, status_param_message", [
    ({"n": 2}, (400, "n", "n must be 1: one completion per request is supported, got 2")),
    ({"n": 0}, (400, "n", "n must be 1: one completion per request is supported, got 0")),
    ({"top_logprobs": 2}, (400, "top_logprobs", "top_logprobs needs logprobs set to true")),
    ({"temperature": "hot"}, (400, "temperature", "temperature: Expected `float | null`, got `str`")),
    ({"max_tokens": 1.5}, (400, "max_tokens", "max_tokens: Expected `int | null`, got `float`")),
    ({"stop": [1]}, (400, "stop[0]", "stop[0]: Expected `str`, got `int`")),
    ({"stream_options": {"include_usage": True}},
     (400, "stream_options", "stream_options is only allowed with stream set to true")),
    ({"logit_bias": {"5": 10}}, (400, "logit_bias", "logit_bias is not supported; leave it out")),
    ({"tools": [{"type": "function"}]}, (400, "tools", "tools are not supported; leave tools out")),
    ({"tool_choice": "required"},
     (400, "tool_choice", "tool_choice must be \"none\" or \"auto\" (tools are not supported)")),
    ({"response_format": {"type": "json_object"}},
     (400, "response_format", "response_format type 'json_object' is not supported; use \"text\" or leave it out")),
])
def test_chat_invalid_field_is_a_400_naming_it(fields, status_param_message):
    assert refusal(parse_chat, chat(**fields)) == status_param_message


@pytest.mark.parametrize("messages, status_param_message", [
    ([], (400, "messages", "messages must not be empty; send at least one message")),
    ([{"content": "x"}], (400, "messages[0].role", "messages[0].role is required")),
    ([{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}],
     (400, "messages[1].role", "role must be one of system, developer, user, assistant, tool, got 'wizard'")),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     (400, "messages[0].content[0]",
      "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported, got type 'image_url'")),
    ([{"role": "user", "content": 5}],
     (400, "messages[0].content", "messages[0].content: Expected `str | array | null`, got `int`")),
])
def test_chat_bad_messages_name_the_message(messages, status_param_message):
    assert refusal(parse_chat, body(messages=messages)) == status_param_message


@pytest.mark.parametrize("data, message", [
    (b"{", "the request body is not valid JSON (Input data was truncated)"),
    (b"", "the request body is not valid JSON (Input data was truncated)"),
    (b"\xff", "the request body is not valid JSON (JSON is malformed: invalid character (byte 0))"),
    (b"[]", "request body: Expected `object`, got `array`"),
    (b"{}", "prompt is required"),
])
def test_malformed_completion_body_is_a_400(data, message):
    status, param, got = refusal(parse_completion, data)
    assert (status, got) == (400, message)
    assert param == ("prompt" if data == b"{}" else None)


def test_completion_only_fields_refused():
    assert refusal(parse_completion, body(prompt="x", echo=True)) == \
        (400, "echo", "echo is not supported; leave it out or set it to false")
    assert refusal(parse_completion, body(prompt="x", suffix="s")) == \
        (400, "suffix", "suffix is not supported; leave it out")
    assert refusal(parse_completion, body(prompt="x", best_of=3)) == \
        (400, "best_of", "best_of must be 1 (or left out), got 3")
    assert refusal(parse_completion, body(prompt="x", logprobs=21)) == \
        (400, "logprobs", sampling_refusal(logprobs=21))


def test_unknown_fields_are_ignored():
    assert parse_chat(chat(parallel_tool_calls=False, metadata={"a": 1})).params == SamplingParams()


@settings(max_examples=100, deadline=None)
@given(st.one_of(
    st.binary(max_size=64),
    st.dictionaries(st.sampled_from(["prompt", "messages", "max_tokens", "temperature", "n", "stop", "logprobs",
                                     "top_logprobs", "seed", "top_p", "stream", "stream_options", "top_k"]),
                    st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                                 lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c,
                                                                                     max_size=3),
                                 max_leaves=8)).map(lambda d: json.dumps(d).encode()),
))
def test_any_body_parses_or_is_a_protocol_error(data):
    for parse in (parse_completion, parse_chat):
        try:
            parsed = parse(data)
        except ProtocolError as e:
            assert e.status == 400 and json.loads(e.body())["error"]["message"] == e.message
        else:
            assert isinstance(parsed.params, SamplingParams)


# -- context length, model name -------------------------------------------------


def test_fit_to_context_fills_max_tokens_with_the_room_left():
    assert fit_to_context(parse_completion(body(prompt="x")), 10, 64).max_tokens == 54
    assert fit_to_context(parse_completion(body(prompt="x", max_tokens=54)), 10, 64).max_tokens == 54


def test_model_default_max_tokens_is_capped_by_the_context_not_refused():
    defaults = generation_defaults({"max_new_tokens": 256})
    assert fit_to_context(parse_chat(chat(), defaults), 10, 64).max_tokens == 54
    assert fit_to_context(parse_chat(chat(), defaults), 10, 1024).max_tokens == 256
    with pytest.raises(ProtocolError):
        fit_to_context(parse_chat(chat(max_tokens=256), defaults), 10, 64)


def test_prompt_plus_max_tokens_over_context_states_both_numbers():
    with pytest.raises(ProtocolError) as e:
        fit_to_context(parse_chat(chat(max_completion_tokens=60)), 10, 64)
    assert (e.value.status, e.value.param, e.value.message) == (
        400, "max_completion_tokens",
        "the prompt (10 tokens) plus max_completion_tokens (60) is 70 tokens, more than the context length "
        "(--max-model-len) 64; set max_completion_tokens to at most 54")
    with pytest.raises(ProtocolError) as e:
        fit_to_context(parse_completion(body(prompt="x")), 64, 64)
    assert (e.value.param, e.value.message) == (
        "prompt", "the prompt is 64 tokens and the context length (--max-model-len) is 64: "
                  "no room for a single token; shorten the prompt")


def test_check_model_accepts_the_served_name_or_none_and_404s_others():
    check_model(parse_chat(chat(model="smol")).request, "smol")
    check_model(parse_chat(chat()).request, "smol")
    with pytest.raises(ProtocolError) as e:
        check_model(parse_chat(chat(model="gpt-4")).request, "smol")
    assert json.loads(e.value.body()) == {"error": {
        "message": "the model 'gpt-4' does not exist; this server serves 'smol'", "type": "not_found_error",
        "param": "model", "code": "model_not_found"}}


# -- responses ----------------------------------------------------------------------


def test_error_body_has_openai_shape_and_type_by_status():
    assert json.loads(error_body(429, "queue full", code="rate_limit_exceeded")) == {"error": {
        "message": "queue full", "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}}
    assert json.loads(error_body(503, "draining"))["error"]["type"] == "service_unavailable"
    assert json.loads(error_body(401, "bad key"))["error"]["type"] == "authentication_error"


def test_completion_response_shape():
    lp = completion_logprobs(["He", "llo"], [-0.5, float("-inf")], [[("He", -0.5)], [("llo", -1e9)]], 4)
    got = json.loads(encode(completion_response("r1", "smol", 1700000000, "Hello", "length", usage(3, 2), lp)))
    assert got == {
        "id": "cmpl-r1", "object": "text_completion", "created": 1700000000, "model": "smol",
        "choices": [{"index": 0, "text": "Hello", "finish_reason": "length",
                     "logprobs": {"tokens": ["He", "llo"], "token_logprobs": [-0.5, -9999.0],
                                  "top_logprobs": [{"He": -0.5}, {"llo": -9999.0}], "text_offset": [4, 6]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


def test_chat_response_shape_with_cached_tokens_and_logprobs():
    lp = chat_token_logprob("é", -0.25, [("é", -0.25), ("e", -2.0)])
    got = json.loads(encode(chat_completion_response("r2", "smol", 5, "é", "stop", usage(10, 1, cached_tokens=8),
                                                     ChatLogprobs(content=[lp]))))
    assert got == {
        "id": "chatcmpl-r2", "object": "chat.completion", "created": 5, "model": "smol",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "é"}, "finish_reason": "stop",
                     "logprobs": {"content": [{"token": "é", "logprob": -0.25, "bytes": [195, 169],
                                               "top_logprobs": [{"token": "é", "logprob": -0.25, "bytes": [195, 169]},
                                                                {"token": "e", "logprob": -2.0, "bytes": [101]}]}]}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11,
                  "prompt_tokens_details": {"cached_tokens": 8}}}


def test_sse_stream_bytes():
    first = sse(chat_completion_chunk("r3", "smol", 5, role="assistant", content=""))
    assert first == (b'data: {"id":"chatcmpl-r3","object":"chat.completion.chunk","created":5,"model":"smol",'
                     b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
                     b'"finish_reason":null}],"usage":null}\n\n')
    last = json.loads(sse(chat_completion_chunk("r3", "smol", 5, finish_reason="stop"))[6:])
    assert last["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    tail = json.loads(sse(chat_usage_chunk("r3", "smol", 5, usage(4, 2)))[6:])
    assert (tail["choices"], tail["usage"]) == ([], {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6})
    text = json.loads(sse(completion_chunk("r4", "smol", 5, "Hi"))[6:])
    assert (text["id"], text["object"], text["choices"][0]["text"], text["usage"]) == \
        ("cmpl-r4", "text_completion", "Hi", None)
    assert json.loads(sse(completion_usage_chunk("r4", "smol", 5, usage(1, 1)))[6:])["choices"] == []
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_responses_parse_with_the_openai_sdk_types():
    from openai.types import Completion, Model
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    c = Completion.model_validate_json(encode(completion_response("a", "m", 1, "x", "stop", usage(1, 1))))
    assert (c.id, c.choices[0].text, c.usage.total_tokens) == ("cmpl-a", "x", 2)
    cc = ChatCompletion.model_validate_json(encode(chat_completion_response("a", "m", 1, "y", "length", usage(2, 3))))
    assert (cc.id, cc.choices[0].message.content, cc.choices[0].finish_reason) == ("chatcmpl-a", "y", "length")
    ch = ChatCompletionChunk.model_validate_json(encode(chat_completion_chunk("a", "m", 1, content="z")))
    assert (ch.choices[0].delta.content, ch.choices[0].delta.role) == ("z", None)
    models = msgspec.json.decode(encode(model_list("smol", 7, 2048)))
    assert models == {"object": "list", "data": [{"id": "smol", "object": "model", "created": 7,
                                                  "owned_by": "radianced", "max_model_len": 2048}]}
    assert Model.model_validate(models["data"][0]).id == "smol"


def test_an_sse_event_stays_one_line_for_a_client_that_splits_as_str_splitlines_does():
    text = "a\u2028b\u2029c\x85d\u00e9"  # line separators a JSON string carries raw, and a plain non-ASCII letter
    event = sse(completion_chunk("r5", "smol", 5, text))
    assert event.endswith(b"\n\n") and len(event.decode().splitlines()) == 2  # the event's line and the blank line
    assert json.loads(event[6:])["choices"][0]["text"] == text
    assert "\u00e9".encode() in event  # only the separators are escaped
