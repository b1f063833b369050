"""A parsed request -> its prompt token ids: the completion's text or ids, the chat template's rendering.

Raises ProtocolError(400) naming the field when the prompt cannot be built:
the template refuses the messages, they render or encode to no tokens, or
`chat_template_kwargs` tries to set what the template call itself passes.
"""

from __future__ import annotations

from radianced.model.tokenizer import ChatTemplateError, Tokenizer
from radianced.server.api_errors import ProtocolError
from radianced.server.api_requests import ChatCompletionRequest, CompletionRequest

# keys the template call itself passes: a request may not set them through chat_template_kwargs
RESERVED_TEMPLATE_KEYS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


def completion_prompt(tok: Tokenizer, req: CompletionRequest) -> list[int]:
    if isinstance(req.prompt, list):
        return req.prompt
    ids = tok.encode(req.prompt, add_special_tokens=True)
    if not ids:
        raise ProtocolError(400, "the prompt encodes to no tokens", "prompt")
    return ids


def chat_prompt(tok: Tokenizer, req: ChatCompletionRequest) -> list[int]:
    kwargs = req.chat_template_kwargs or {}
    reserved = sorted(RESERVED_TEMPLATE_KEYS & kwargs.keys())
    if reserved:
        raise ProtocolError(400, f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    try:
        text = tok.apply_chat_template(req.template_messages(), add_generation_prompt=req.add_generation_prompt,
                                       **kwargs)
    except ChatTemplateError as e:
        raise ProtocolError(400, str(e), "messages") from None
    except (TypeError, ValueError, LookupError, AttributeError) as e:  # template code tripping on odd input
        raise ProtocolError(400, f"the chat template failed on these messages: {e}", "messages") from None
    ids = tok.encode(text)
    if not ids:
        raise ProtocolError(400, "the chat template renders these messages to no tokens", "messages")
    return ids
