"""One streamed request read from fixed SSE bodies (httpx's MockTransport): tokens, usage, errors."""

from __future__ import annotations

import json

import httpx

from radianced.bench.client import chat_body, completion_body, stream_request


def _sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def _completion_chunk(text: str, tokens: list[str], finish: str | None = None) -> dict:
    lp = {"tokens": tokens, "token_logprobs": [-0.1] * len(tokens), "top_logprobs": None, "text_offset": [0]}
    return {"choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                                  "prompt_tokens_details": {"cached_tokens": 4}}}


async def _send(body: bytes, status: int = 200, path: str = "/v1/completions", request: dict | None = None,
                piece: int | None = None):
    """The sample of one request answered with `body`, sent whole or `piece` bytes at a time."""
    seen = []

    async def pieces():
        for i in range(0, len(body), piece):
            yield body[i:i + piece]

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(json.loads(req.content))
        return httpx.Response(status, content=body if piece is None else pieces(),
                              headers={"content-type": "text/event-stream"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://bench") as http:
        sample = await stream_request(http, path, request or completion_body([1, 2, 3], 3))
    return sample, seen[0]


async def test_every_logprobs_entry_is_one_token_even_when_its_text_is_held_back():
    body = _sse(_completion_chunk("Hel", ["Hel"]), _completion_chunk("", ["\u00e2"]),  # a split character
                _completion_chunk("lo", ["lo"], "length"), USAGE, b"[DONE]")
    s, sent = await _send(body)
    assert sent["stream"] and sent["logprobs"] == 0 and sent["stream_options"] == {"include_usage": True}
    assert (s.status, s.tokens_received, s.completion_tokens, s.prompt_tokens, s.cached_tokens) == (200, 3, 3, 7, 4)
    assert s.pieces == ("Hel", "\u00e2", "lo") and s.finish_reason == "length"
    assert s.done and s.ok and not s.cut_short and len(s.itl_s) == 2 and s.ttft_s <= s.e2e_s


async def test_chat_chunks_carry_their_tokens_in_logprobs_content_and_the_role_chunk_none():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    tok = {"choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": {"content": [
        {"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": []}]}, "finish_reason": "stop"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}
    s, sent = await _send(_sse(role, tok, usage, b"[DONE]"), path="/v1/chat/completions",
                          request=chat_body([{"role": "user", "content": "hi"}], 8))
    assert sent["logprobs"] is True and sent["messages"][0]["content"] == "hi"
    assert (s.tokens_received, s.completion_tokens, s.finish_reason, s.itl_s) == (1, 1, "stop", ())
    assert s.cached_tokens is None  # no prompt_tokens_details in this usage
    assert s.ok


async def test_a_429_is_a_sample_with_its_body_not_an_exception():
    s, _ = await _send(b'{"error": {"message": "8 requests are waiting"}}', status=429)
    assert (s.status, s.tokens_received, s.ttft_s, s.done, s.ok, s.cut_short) == (429, 0, None, False, False, False)
    assert "8 requests are waiting" in s.error


async def test_a_stream_that_stops_without_done_is_cut_short():
    s, _ = await _send(_sse(_completion_chunk("a", ["a"])))
    assert s.cut_short and not s.ok and s.completion_tokens is None


async def test_an_error_event_inside_a_stream_is_cut_short():
    s, _ = await _send(_sse(_completion_chunk("a", ["a"]), {"error": {"message": "engine failed"}}, b"[DONE]"))
    assert s.cut_short and "engine failed" in s.error


async def test_a_refused_connection_is_status_0():
    def handler(req):
        raise httpx.ConnectError("refused")

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://bench") as http:
        s = await stream_request(http, "/v1/completions", completion_body("x", 1))
    assert (s.status, s.e2e_s, s.ok, s.cut_short) == (0, None, False, False) and "ConnectError" in s.error


async def test_a_line_separator_inside_a_token_does_not_cut_the_event():
    raw = _sse(_completion_chunk("a\u2028b", ["a\u2028", "b"]), USAGE, b"[DONE]")
    raw = raw.replace(b"\\u2028", "\u2028".encode())  # sent raw, as JSON allows
    raw = raw.replace(b"\n\n", b"\r\n\r\n", 1)  # and one event ended by CRLF
    for piece in (None, 1, 7):  # whole, a byte at a time (a CRLF split across reads), and odd pieces
        s, _ = await _send(raw, piece=piece)
        assert s.ok and s.pieces == ("a\u2028", "b") and s.tokens_received == 2
