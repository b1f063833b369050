"""The HTTP path's first uses, paid before ready: requests the daemon sends itself through its own socket.

The engine's warm-up (engine/warmup.py) builds every kernel variant and serves
requests through the running `AsyncEngine`, but a user's first request still paid
for the layers above it: on a 2-core CPU the first completion after ready took
~40 ms longer than the same length next, and py-spy put that time in the event
loop importing anyio's asyncio backend (starlette's streaming response loads it
lazily) and building the dataclasses of the modules it pulls in; on the H200 the
first request after ready took 123 ms against its twin's 25 (bench/README,
session 15). So, before /health says ready, the daemon connects to the
listening socket its HTTP front serves (TCP or --http-socket) and sends what clients send: a streamed
text completion, a completion of token ids answered whole, and a streamed chat
completion when the model has a chat template. uvicorn's protocol, the request
context, the routes, body decoding, tokenizing, the chat template, the frames
to the daemon, its detokenizer and the SSE writer each run once.

These requests carry a per-process token (random, never logged: the daemon sends
it to the front with the phase, `ServerState.warm_up_token` there) in the
`WARM_UP_HEADER` header: the only requests the routes admit while loading. The
request context leaves them out of the request counter, and the engine's metrics
are off while they run (`warm_up_served`).
"""

from __future__ import annotations

import asyncio
import json
import socket

WARM_UP_HEADER = "x-radianced-warm-up"
TIMEOUT_S = 120.0  # a whole request; the engine is warm, so this is only a bound on a hang


class SelfWarmupError(RuntimeError):
    """A warm-up request through the daemon's own socket was not answered 200."""


def address_of(sock: socket.socket) -> tuple[str, int] | str:
    """Where to reach the listening `sock`: (host, port), a wildcard bind reached on loopback, or the
    unix socket's path."""
    if sock.family == socket.AF_UNIX:
        return sock.getsockname()
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1" if sock.family == socket.AF_INET else "::1"
    return host, port


def bodies(model: str, chat: bool) -> list[tuple[str, dict]]:
    """(path, JSON body) of each warm-up request."""
    out = [("/v1/completions", {"model": model, "prompt": "The warm-up", "max_tokens": 2, "temperature": 0,
                                "stream": True, "stream_options": {"include_usage": True}}),
           ("/v1/completions", {"model": model, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0,
                                "logprobs": 1})]
    if chat:
        out.append(("/v1/chat/completions", {"model": model, "max_tokens": 2, "temperature": 0, "stream": True,
                                             "messages": [{"role": "user", "content": "Warm up."}]}))
    return out


async def warm_up_http(where: tuple[str, int] | str, token: str, model: str, chat: bool,
                       api_key: str | None = None) -> int:
    """Send `bodies` to the daemon at `where`, one after another, each on its own connection; the
    number sent. Raises SelfWarmupError naming the request that was not answered 200."""
    bearer = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sent = 0
    for path, body in bodies(model, chat):
        status, answer = await asyncio.wait_for(_post(where, path, body, {WARM_UP_HEADER: token, **bearer}),
                                                TIMEOUT_S)
        if status != 200:
            raise SelfWarmupError(f"the warm-up request POST {path} through the daemon's own socket was "
                                  f"answered {status}: {answer[:300]!r}")
        sent += 1
    return sent


async def _post(where: tuple[str, int] | str, path: str, body: dict, headers: dict[str, str]) -> tuple[int, bytes]:
    """One HTTP/1.1 POST on a fresh connection (closed by the server after it): (status, the rest)."""
    if isinstance(where, str):
        reader, writer = await asyncio.open_unix_connection(where)
    else:
        reader, writer = await asyncio.open_connection(*where)
    data = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", "Host: radianced", "Content-Type: application/json",
            f"Content-Length: {len(data)}", "Connection: close", *(f"{k}: {v}" for k, v in headers.items())]
    try:
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        await writer.drain()
        answer = await reader.read()
    finally:
        writer.close()
    status_line = answer.split(b"\r\n", 1)[0].split()
    status = int(status_line[1]) if len(status_line) >= 2 and status_line[1].isdigit() else 0
    return status, answer
