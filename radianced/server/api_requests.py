"""OpenAI request bodies in, a valid request and its `SamplingParams` out.

Requests are msgspec Structs decoded straight from the body bytes. Field names
are OpenAI's, plus vLLM's extras (top_k, min_p, repetition_penalty,
stop_token_ids, ignore_eos, ...), so both kinds of client work unmodified.
Unknown fields are ignored (clients send many); fields that would change the
answer and that radianced cannot honour (n > 1, tools, echo, logit_bias, a JSON
response_format, ...) are refused, never silently dropped.

`parse_completion` / `parse_chat` turn the bytes into a `Parsed` (the request
and its `SamplingParams`) or raise `ProtocolError` (api_errors.py), whose
`param` names the offending field. Sampling values come from the request, else
from the model's generation_config.json (`generation_defaults`), else
SamplingParams' own.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import msgspec

from radianced.engine.sampling_params import InvalidSamplingParams, SamplingParams
from radianced.server import limits
from radianced.server.api_errors import ProtocolError
from radianced.server.body_decoding import decode

log = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool")
BATCH_REFUSAL = "batch prompts are not supported; send one prompt per request"


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields both endpoints share. None means "not given": the model's default applies."""

    model: str | None = None  # None: the served model
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling, kw_only=True):
    """POST /v1/completions. After `parse_completion`, `prompt` is one prompt:
    text (non-empty) or token ids (non-empty, each in [0, vocab_size))."""

    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str | None:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str


class ChatCompletionRequest(_Sampling, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are given
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false} for Qwen3

    @property
    def max_tokens_param(self) -> str:
        """The field the request set its output limit with (for error messages)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def template_messages(self) -> list[dict]:
        """The conversation as `Tokenizer.apply_chat_template` takes it."""
        return [{"role": m.role, "content": m.text(), "name": m.name} for m in self.messages]


class Parsed(NamedTuple):
    """A valid request and the sampling it asks for."""

    request: CompletionRequest | ChatCompletionRequest
    params: SamplingParams


# -- parsing ------------------------------------------------------------------

# generation_config.json keys that set a sampling default -> SamplingParams field.
# do_sample is ignored, as vLLM ignores it: the values a model ships are the ones it wants sampled with.
_GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(generation: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling defaults in a model's generation_config.json (the `.rad` header's
    `generation`), as SamplingParams fields. A value SamplingParams refuses is
    dropped with a warning: a bad model file must not fail every request."""
    out: dict[str, Any] = {}
    for key, field in _GENERATION_KEYS.items():
        if generation.get(key) is None:
            continue
        try:
            SamplingParams(**{field: generation[key]})
        except (InvalidSamplingParams, TypeError) as e:
            log.warning("generation_config.json %s=%r ignored: %s", key, generation[key], e)
            continue
        out[field] = generation[key]
    return out


def parse_completion(data: bytes, defaults: Mapping[str, Any] | None = None, *,
                     vocab_size: int | None = None) -> Parsed:
    """Decode a /v1/completions body. `defaults` are SamplingParams fields the
    request may override (`generation_defaults(header.generation)`); token-id
    prompts and top_k are checked against `vocab_size` when given. Raises ProtocolError(400)."""
    req = decode(data, CompletionRequest)
    req.prompt = _one_prompt(req.prompt, vocab_size)
    if req.echo:
        raise ProtocolError(400, "echo is not supported; leave it out or set it to false", "echo")
    if req.suffix is not None:
        raise ProtocolError(400, "suffix is not supported; leave it out", "suffix")
    if req.best_of not in (None, 1):
        raise ProtocolError(400, f"best_of must be 1 (or left out), got {req.best_of}", "best_of")
    params = _sampling_params(req, defaults, vocab_size, max_tokens=(req.max_tokens, "max_tokens"),
                              logprobs=(req.logprobs, "logprobs"))
    return Parsed(req, params)


def parse_chat(data: bytes, defaults: Mapping[str, Any] | None = None, *, vocab_size: int | None = None) -> Parsed:
    """Decode a /v1/chat/completions body; see `parse_completion`. Raises ProtocolError(400)."""
    req = decode(data, ChatCompletionRequest)
    if not req.messages:
        raise ProtocolError(400, "messages must not be empty; send at least one message", "messages")
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            raise ProtocolError(400, f"role must be one of {', '.join(ROLES)}, got {m.role!r}",
                                f"messages[{i}].role")
        if m.content is None:  # OpenAI allows null only beside tool_calls, which are not supported
            raise ProtocolError(400, f"messages[{i}].content is required (a string or a list of text parts); null "
                                "goes only beside tool_calls, which are not supported", f"messages[{i}].content")
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            if part.type != "text" or part.text is None:
                raise ProtocolError(400, f"only text content parts ({{\"type\": \"text\", \"text\": ...}}) "
                                    f"are supported, got type {part.type!r}", f"messages[{i}].content[{j}]")
    if req.tools:
        raise ProtocolError(400, "tools are not supported; leave tools out", "tools")
    if req.tool_choice not in (None, "none", "auto"):
        raise ProtocolError(400, "tool_choice must be \"none\" or \"auto\" (tools are not supported)", "tool_choice")
    if req.response_format is not None and req.response_format.type != "text":
        raise ProtocolError(400, f"response_format type {req.response_format.type!r} is not supported; "
                            "use \"text\" or leave it out", "response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise ProtocolError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
    limits.check_template_kwargs(req.chat_template_kwargs or {})
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _sampling_params(req, defaults, vocab_size, max_tokens=(max_tokens, req.max_tokens_param),
                              logprobs=(logprobs, "top_logprobs"))
    return Parsed(req, params)


def fit_to_context(parsed: Parsed, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """The params to run with: max_tokens as the request asked, else the model's
    default or all the context leaves, whichever is smaller.

    Raises ProtocolError(400) stating both numbers when the prompt fills the
    context or the request's own max_tokens does not fit beside it.
    """
    req, params = parsed
    chat = isinstance(req, ChatCompletionRequest)
    param = req.max_tokens_param if chat else "max_tokens"
    asked = req.max_tokens is not None or (chat and req.max_completion_tokens is not None)
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise ProtocolError(400, f"the prompt is {num_prompt_tokens} tokens and the context length "
                            f"(--max-model-len) is {max_model_len}: no room for a single token; "
                            f"shorten the prompt", "messages" if chat else "prompt")
    if not asked or params.max_tokens is None:
        return msgspec.structs.replace(params, max_tokens=min(params.max_tokens or room, room))
    if params.max_tokens > room:
        raise ProtocolError(400, f"the prompt ({num_prompt_tokens} tokens) plus {param} ({params.max_tokens}) "
                            f"is {num_prompt_tokens + params.max_tokens} tokens, more than the context length "
                            f"(--max-model-len) {max_model_len}; set {param} to at most {room}", param)
    return params


def check_model(req: CompletionRequest | ChatCompletionRequest, served_model_name: str) -> None:
    """Raise ProtocolError(404) unless the request names the served model (or no model)."""
    if req.model is not None and req.model != served_model_name:
        raise ProtocolError(404, f"the model {req.model!r} does not exist; this server serves "
                            f"{served_model_name!r}", "model", code="model_not_found")


def _one_prompt(prompt: str | list[Any], vocab_size: int | None) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one is that prompt
    if isinstance(prompt, str):
        if not prompt:
            raise ProtocolError(400, "prompt must not be empty", "prompt")
        return prompt
    if not prompt:
        raise ProtocolError(400, "prompt must not be empty", "prompt")
    if all(isinstance(p, (str, list)) for p in prompt):
        raise ProtocolError(400, BATCH_REFUSAL, "prompt")
    # The common case by builtins that loop in C (2,000 ids: 70 us against 128 for the loop below, on a prepare
    # thread, which holds the GIL the step thread waits for); the loop then names what is wrong, and where.
    if set(map(type, prompt)) == {int} and min(prompt) >= 0 and (vocab_size is None or max(prompt) < vocab_size):
        return prompt
    for i, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, int):
            raise ProtocolError(400, f"prompt must be a string or a list of token ids, got {t!r} at prompt[{i}]",
                                "prompt")
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            top = f"{vocab_size - 1}" if vocab_size is not None else "the vocabulary size"
            raise ProtocolError(400, f"token id {t} at prompt[{i}] is outside this model's vocabulary "
                                f"(0..{top})", "prompt")
    return prompt


_SHARED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "frequency_penalty",
                  "presence_penalty", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output",
                  "skip_special_tokens")
_FIELD = re.compile(r"^(\w+) ")


def _sampling_params(req: _Sampling, defaults: Mapping[str, Any] | None, vocab_size: int | None, *,
                     max_tokens: tuple[int | None, str], logprobs: tuple[int | None, str]) -> SamplingParams:
    """SamplingParams from the request over `defaults`. `max_tokens` and `logprobs`
    are (value, the request field it came from), for error messages."""
    limits.check_stops(req.stop, req.stop_token_ids, vocab_size)
    limits.check_top_k(req.top_k, vocab_size)
    if req.n not in (None, 1):
        raise ProtocolError(400, f"n must be 1: one completion per request is supported, got {req.n}", "n")
    if req.logit_bias:
        raise ProtocolError(400, "logit_bias is not supported; leave it out", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise ProtocolError(400, "stream_options is only allowed with stream set to true", "stream_options")
    kw = {k: v for k, v in (defaults or {}).items() if k in SamplingParams.__struct_fields__}
    given = {f: getattr(req, f) for f in _SHARED_FIELDS}
    given["max_tokens"], given["logprobs"] = max_tokens[0], logprobs[0]
    kw.update({k: v for k, v in given.items() if v is not None})
    try:
        return SamplingParams(**kw)
    except InvalidSamplingParams as e:
        message = str(e)
        m = _FIELD.match(message)
        field = m[1] if m else None
        param = {"max_tokens": max_tokens[1], "logprobs": logprobs[1]}.get(field, field)
        if field and param != field:
            message = param + message[len(field):]
        raise ProtocolError(400, message, param) from None

