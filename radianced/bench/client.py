"""One streamed request as the client sees it: send, read the SSE events, time every token.

Every request asks for logprobs, so each generated token arrives as one
logprobs entry (the daemon sends one per token, even for a token whose text is
held back): counting those entries counts the tokens received, which the
report checks against the usage chunk's `completion_tokens`. The times follow
`vllm bench serve`: TTFT from sending to the first chunk carrying a token, ITL
between successive token-carrying chunks, end-to-end to the last event.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True)
class Sample:
    """One request: what came back and when (seconds are `time.perf_counter` differences)."""

    status: int  # HTTP status of the response; 0 when the connection failed before one came
    sent_at: float  # perf_counter when the request was sent (for the workload's duration)
    ttft_s: float | None  # sending to the first token-carrying chunk; None when no token came
    e2e_s: float | None  # sending to the stream's last event; None when no response came
    itl_s: tuple[float, ...]  # gaps between successive token-carrying chunks
    tokens_received: int  # logprobs entries counted in the stream, one per generated token
    completion_tokens: int | None  # the usage chunk's count; None when the stream sent no usage
    prompt_tokens: int | None  # the usage chunk's prompt length
    cached_tokens: int | None  # prompt tokens the daemon's prefix cache supplied (usage details)
    finish_reason: str | None  # "length", "stop", ...; None when the stream never said
    done: bool  # the stream ended with `data: [DONE]`
    error: str | None  # an error body or event, or the transport error; None on success
    pieces: tuple[str, ...] = field(default=(), repr=False)  # each token's text, for the quality check

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None

    @property
    def cut_short(self) -> bool:
        """A 200 whose stream ended without [DONE], carried an error event, or lost tokens."""
        return self.status == 200 and (not self.done or self.error is not None
                                       or self.completion_tokens != self.tokens_received)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (tokens - 1), as vLLM defines it."""
        if self.ttft_s is None or self.e2e_s is None or self.tokens_received < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.tokens_received - 1)


def completion_body(prompt: str | list[int], max_tokens: int, ignore_eos: bool = True) -> dict:
    """A greedy streamed /v1/completions body that reports usage and one logprobs entry per token."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "logprobs": 0,
            "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}}


def chat_body(messages: list[dict], max_tokens: int) -> dict:
    """A greedy streamed /v1/chat/completions body with usage and logprobs."""
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True, "logprobs": True,
            "stream_options": {"include_usage": True}}


class _Reading:
    """What the events of one stream have said so far."""

    def __init__(self, sent: float):
        self.sent = sent
        self.first: float | None = None
        self.last_token: float | None = None
        self.itl: list[float] = []
        self.pieces: list[str] = []
        self.usage: dict | None = None
        self.finish: str | None = None
        self.done = False
        self.error: str | None = None

    def event(self, data: str, now: float) -> None:
        if data == "[DONE]":
            self.done = True
            return
        obj = json.loads(data)
        if "error" in obj:
            self.error = json.dumps(obj["error"])
            return
        if obj.get("usage"):
            self.usage = obj["usage"]
        for choice in obj.get("choices", ()):
            pieces = _token_pieces(choice)
            if pieces:
                if self.first is None:
                    self.first = now
                else:
                    self.itl.append(now - self.last_token)
                self.last_token = now
                self.pieces += pieces
            self.finish = choice.get("finish_reason") or self.finish


def _token_pieces(choice: dict) -> list[str]:
    """The tokens one chunk carries: completions' `logprobs.tokens` or chat's `logprobs.content`."""
    lp = choice.get("logprobs")
    if not lp:
        return []
    if "tokens" in lp:
        return list(lp["tokens"])
    return [c["token"] for c in lp.get("content") or ()]


async def sse_lines(resp: httpx.Response):
    """The lines of an event stream as the SSE spec splits them: on CR, LF or CRLF only.

    Not `aiter_lines`: it splits as `str.splitlines` does, also on U+0085, U+2028 and U+2029,
    which a JSON string may carry raw, cutting one event in two.
    """
    pending = b""
    async for data in resp.aiter_bytes():
        lines = (pending + data).splitlines(keepends=True)  # bytes split on CR, LF and CRLF only
        pending = b""
        if lines and not lines[-1].endswith((b"\n", b"\r")):
            pending = lines.pop()
        elif lines and lines[-1].endswith(b"\r"):
            pending = lines.pop()  # a CR at a chunk's end may be the first half of a CRLF
        for line in lines:
            yield line.rstrip(b"\r\n")
    if pending:
        yield pending.rstrip(b"\r\n")


async def stream_request(http: httpx.AsyncClient, path: str, body: dict) -> Sample:
    """POST `body` (stream: true) to `path` and read it to the end; never raises for HTTP or transport
    errors (they become the sample's status and error)."""
    sent = time.perf_counter()
    r = _Reading(sent)
    status = 0
    try:
        async with http.stream("POST", path, json=body) as resp:
            status = resp.status_code
            if status != 200:
                r.error = (await resp.aread()).decode(errors="replace")[:500]
            else:
                async for line in sse_lines(resp):
                    if line.startswith(b"data: "):
                        r.event(line[6:].decode(), time.perf_counter())
    except httpx.HTTPError as e:
        r.error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    usage = r.usage or {}
    details = usage.get("prompt_tokens_details") or {}
    return Sample(status=status, sent_at=sent, ttft_s=None if r.first is None else r.first - sent,
                  e2e_s=end - sent if status else None, itl_s=tuple(r.itl), tokens_received=len(r.pieces),
                  completion_tokens=usage.get("completion_tokens"), prompt_tokens=usage.get("prompt_tokens"),
                  cached_tokens=details.get("cached_tokens"), finish_reason=r.finish, done=r.done,
                  error=r.error, pieces=tuple(r.pieces))
