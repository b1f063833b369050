"""What one request may ask for: the limits on its input, in one place (the README's "Limits" lists them).

Each limit keeps the worst case of a hostile request small, so that the event
loop, which answers /health and every stream, never waits long on one
request's input. Past a limit the request gets a 4xx naming it. The timeouts
on slow clients are flags (`--timeout-headers`, `--timeout-body`,
`--timeout-keep-alive`; config.py).
"""

from __future__ import annotations

from typing import Any

from radianced.server.api_errors import ProtocolError

# A body cap well above any real prompt: a 256K-token context is ~1.3 MB of text or
# ~1.8 MB of token ids as JSON; chat JSON escaping can double text. Past this, 413.
MAX_BODY_BYTES = 8 << 20

# Stop strings. OpenAI takes up to 4; TGI's default is 4 too. 16 strings of up to 512
# characters cover every real use; the stop check is linear in the text it scans
# (engine/detokenizer.py), and its set-up is linear in these, so they bound its cost
# per request. (Before the limits and the linear check, one 1 MB stop string held the
# event loop 17.7 s per token.)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
# Stop token ids: a set built on the event loop when the request is queued.
MAX_STOP_TOKEN_IDS = 1024

# chat_template_kwargs reach the model's Jinja template as they are; a template that
# walks a deep value (tojson) would recurse past Python's limit.
MAX_TEMPLATE_KWARGS_DEPTH = 32


def max_prompt_bytes(max_model_len: int, max_token_bytes: int) -> int:
    """The longest prompt text, in UTF-8 bytes, that --max-model-len could ever admit.

    No token stands for more than `max_token_bytes` bytes of text (tokenizer.py's
    `max_token_bytes`), so a longer text needs more than `max_model_len` tokens.
    Checked before tokenizing: an 8 MB prompt used to cost 10.8 s of tokenizing
    before its 400.
    """
    return max_model_len * max_token_bytes


def check_stops(stop: str | list[str] | None, stop_token_ids: list[int] | None,
                vocab_size: int | None = None) -> None:
    """ProtocolError(400) naming `stop` or `stop_token_ids` past MAX_STOP_STRINGS, MAX_STOP_CHARS
    or MAX_STOP_TOKEN_IDS, or a stop token id outside the vocabulary (when `vocab_size` is given)."""
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > MAX_STOP_STRINGS:
        raise ProtocolError(400, f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_CHARS:
            where = "stop" if isinstance(stop, str) else f"stop[{i}]"
            raise ProtocolError(400, f"{where} is {len(s)} characters long; a stop string may have at most "
                                f"{MAX_STOP_CHARS}", "stop")
    if stop_token_ids is not None and len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ProtocolError(400, f"stop_token_ids has {len(stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} "
                            f"are allowed", "stop_token_ids")
    for t in stop_token_ids or ():
        if vocab_size is not None and not 0 <= t < vocab_size:
            raise ProtocolError(400, f"stop_token_ids holds {t}: a token id is in 0..{vocab_size - 1}",
                                "stop_token_ids")


def check_top_k(top_k: int | None, vocab_size: int | None) -> None:
    """ProtocolError(400) for a top_k past the vocabulary (0 and -1 disable it; SamplingParams checks the rest)."""
    if top_k is not None and vocab_size is not None and top_k > vocab_size:
        raise ProtocolError(400, f"top_k must be at most the vocabulary size ({vocab_size}), or 0 / -1 to disable "
                            f"it, got {top_k}", "top_k")


def check_template_kwargs(kwargs: dict[str, Any]) -> None:
    """ProtocolError(400) when a chat_template_kwargs value nests deeper than MAX_TEMPLATE_KWARGS_DEPTH."""
    todo = [(v, 1) for v in kwargs.values()]
    while todo:
        value, depth = todo.pop()
        if depth > MAX_TEMPLATE_KWARGS_DEPTH:
            raise ProtocolError(400, f"chat_template_kwargs nests more than {MAX_TEMPLATE_KWARGS_DEPTH} levels deep",
                                "chat_template_kwargs")
        if isinstance(value, dict):
            todo += [(v, depth + 1) for v in value.values()]
        elif isinstance(value, list):
            todo += [(v, depth + 1) for v in value]


def check_prompt_bytes(nbytes: int, max_model_len: int, max_token_bytes: int, param: str) -> None:
    """ProtocolError(400) naming `param` when a prompt of `nbytes` UTF-8 bytes cannot fit (max_prompt_bytes)."""
    limit = max_prompt_bytes(max_model_len, max_token_bytes)
    if nbytes > limit:
        raise ProtocolError(400, f"the prompt is {nbytes} bytes: more than the {max_model_len} tokens of the context "
                            f"length (--max-model-len) can hold, at most {max_token_bytes} bytes a token of this "
                            f"model ({limit} bytes); shorten the prompt", param)
