"""A request body -> what the engine runs: the checked request, its prompt token ids, its sampling params.

`prepare` runs on a worker thread (http.py), never on the event loop: decoding
an 8 MiB body, rendering a chat template and tokenizing take milliseconds to
seconds, and the loop answers /health and every stream meanwhile. Before any
tokenizing, a prompt's UTF-8 length is checked against what --max-model-len
could ever admit (limits.max_prompt_bytes), so the worst case is bounded too.

Raises ProtocolError(400) naming the field when the prompt cannot be built:
the template refuses the messages, they render or encode to no tokens, or
`chat_template_kwargs` tries to set what the template call itself passes.
"""

from __future__ import annotations

from typing import NamedTuple

from radianced.engine.sampling_params import SamplingParams
from radianced.model.tokenizer import ChatTemplateError
from radianced.server import limits
from radianced.server.api_errors import ProtocolError
from radianced.server.api_requests import (ChatCompletionRequest, CompletionRequest, Parsed, check_model,
                                           fit_to_context, parse_chat, parse_completion)
from radianced.server.state import Served

# keys the template call itself passes: a request may not set them through chat_template_kwargs
RESERVED_TEMPLATE_KEYS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


class Prepared(NamedTuple):
    """A request ready for `AsyncEngine.submit`."""

    parsed: Parsed  # the request and the sampling it asked for
    prompt_ids: list[int]
    params: SamplingParams  # parsed.params with max_tokens fitted to the context


def prepare(served: Served, body: bytes, chat: bool) -> Prepared:
    """Decode and check a /v1/completions (or, with `chat`, /v1/chat/completions) body, build
    its prompt ids and fit its max_tokens to the context. Thread-safe. Raises ProtocolError."""
    if chat:
        parsed = parse_chat(body, served.defaults, vocab_size=served.vocab_size)
    else:
        parsed = parse_completion(body, served.defaults, vocab_size=served.vocab_size)
    check_model(parsed.request, served.name)
    ids = chat_prompt(served, parsed.request) if chat else completion_prompt(served, parsed.request)
    return Prepared(parsed, ids, fit_to_context(parsed, len(ids), served.max_model_len))


def completion_prompt(served: Served, req: CompletionRequest) -> list[int]:
    if isinstance(req.prompt, list):
        return req.prompt
    _check_bytes(served, len(req.prompt.encode()), "prompt")
    ids = served.engine.tokenizer.encode(req.prompt, add_special_tokens=True)
    if not ids:
        raise ProtocolError(400, "the prompt encodes to no tokens", "prompt")
    return ids


def chat_prompt(served: Served, req: ChatCompletionRequest) -> list[int]:
    kwargs = req.chat_template_kwargs or {}
    reserved = sorted(RESERVED_TEMPLATE_KEYS & kwargs.keys())
    if reserved:
        raise ProtocolError(400, f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    messages = req.template_messages()
    _check_bytes(served, sum(len(m["content"].encode()) for m in messages), "messages")
    tok = served.engine.tokenizer
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt, **kwargs)
    except ChatTemplateError as e:
        raise ProtocolError(400, str(e), "messages") from None
    except (TypeError, ValueError, LookupError, AttributeError, RecursionError) as e:  # template code tripping
        raise ProtocolError(400, f"the chat template failed on these messages: {e}", "messages") from None
    ids = tok.encode(text)
    if not ids:
        raise ProtocolError(400, "the chat template renders these messages to no tokens", "messages")
    return ids


def _check_bytes(served: Served, nbytes: int, param: str) -> None:
    limits.check_prompt_bytes(nbytes, served.max_model_len, served.engine.tokenizer.max_token_bytes, param)
