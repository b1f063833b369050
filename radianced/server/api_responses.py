"""OpenAI responses and SSE chunks: the Structs, their builders, and the encoders.

Responses are built by the `*_response` / `*_chunk` functions and encoded by
`encode` (JSON) or `sse` (`data: {...}\\n\\n`; the stream ends with `SSE_DONE`).
The shapes are the ones the openai SDK reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; a token the model gives zero probability reports this (as vLLM does)


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int  # prompt tokens the prefix cache supplied


class Usage(msgspec.Struct, kw_only=True, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> Usage:
    details = PromptTokensDetails(cached_tokens=cached_tokens) if cached_tokens is not None else None
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """The legacy completions format: parallel lists, one entry per generated token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    """A completion, and (as in OpenAI's API) each streamed chunk of one."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob]


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "radianced"
    max_model_len: int | None = None


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


def completion_id(request_id: str) -> str:
    return f"cmpl-{request_id}"


def chat_completion_id(request_id: str) -> str:
    return f"chatcmpl-{request_id}"


def completion_response(request_id: str, model: str, created: int, text: str, finish_reason: str,
                        usage: Usage, logprobs: CompletionLogprobs | None = None) -> CompletionResponse:
    choice = CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish_reason)
    return CompletionResponse(id=completion_id(request_id), created=created, model=model, choices=[choice],
                              usage=usage)


def completion_chunk(request_id: str, model: str, created: int, text: str, finish_reason: str | None = None,
                     logprobs: CompletionLogprobs | None = None) -> CompletionResponse:
    choice = CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish_reason)
    return CompletionResponse(id=completion_id(request_id), created=created, model=model, choices=[choice])


def completion_usage_chunk(request_id: str, model: str, created: int, usage: Usage) -> CompletionResponse:
    """The last chunk of a stream with include_usage: no choices, the usage."""
    return CompletionResponse(id=completion_id(request_id), created=created, model=model, choices=[],
                              usage=usage)


def chat_completion_response(request_id: str, model: str, created: int, content: str, finish_reason: str,
                             usage: Usage, logprobs: ChatLogprobs | None = None) -> ChatCompletionResponse:
    choice = ChatChoice(message=AssistantMessage(content=content), logprobs=logprobs, finish_reason=finish_reason)
    return ChatCompletionResponse(id=chat_completion_id(request_id), created=created, model=model,
                                  choices=[choice], usage=usage)


def chat_completion_chunk(request_id: str, model: str, created: int, *, role: str | None = None,
                          content: str | None = None, finish_reason: str | None = None,
                          logprobs: ChatLogprobs | None = None) -> ChatCompletionChunk:
    """One streamed piece; the first carries role="assistant", the last the finish_reason."""
    choice = ChatChunkChoice(delta=Delta(role=role, content=content), logprobs=logprobs,
                             finish_reason=finish_reason)
    return ChatCompletionChunk(id=chat_completion_id(request_id), created=created, model=model, choices=[choice])


def chat_usage_chunk(request_id: str, model: str, created: int, usage: Usage) -> ChatCompletionChunk:
    """The last chunk of a stream with include_usage: no choices, the usage."""
    return ChatCompletionChunk(id=chat_completion_id(request_id), created=created, model=model, choices=[],
                               usage=usage)


def chat_token_logprob(token: str, logprob: float, top: Sequence[tuple[str, float]] = ()) -> ChatTokenLogprob:
    """One generated token's entry in chat logprobs; `top` is (token, logprob), most likely first."""
    return ChatTokenLogprob(token=token, logprob=_finite(logprob), bytes=list(token.encode()),
                            top_logprobs=[TopLogprob(token=t, logprob=_finite(lp), bytes=list(t.encode()))
                                          for t, lp in top])


def completion_logprobs(tokens: Sequence[str], logprobs: Sequence[float],
                        top: Sequence[Sequence[tuple[str, float]]], text_offset: int = 0) -> CompletionLogprobs:
    """The completions format for generated `tokens` (their text pieces), each token's
    logprob and its top alternatives; offsets count from `text_offset`."""
    offsets, at = [], text_offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return CompletionLogprobs(tokens=list(tokens), token_logprobs=[_finite(lp) for lp in logprobs],
                              top_logprobs=[{t: _finite(lp) for t, lp in alts} for alts in top],
                              text_offset=offsets)


def model_list(name: str, created: int, max_model_len: int | None = None) -> ModelList:
    return ModelList(data=[ModelCard(id=name, created=created, max_model_len=max_model_len)])


def _finite(logprob: float) -> float:
    return max(float(logprob), LOGPROB_FLOOR)


# -- encoding -----------------------------------------------------------------

SSE_DONE = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()


def encode(obj: msgspec.Struct) -> bytes:
    return _encoder.encode(obj)


# Characters JSON may carry raw but `str.splitlines` (httpx's `aiter_lines`, many SSE readers) takes for line
# ends: escaped, so one event stays one line for every client.
_LINE_SEPARATORS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def sse(obj: msgspec.Struct) -> bytes:
    """One server-sent event carrying `obj` as JSON, on one line whichever line ends a client splits on."""
    data = _encoder.encode(obj)
    for raw, escaped in _LINE_SEPARATORS:
        if raw in data:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"

