"""The HTTP API: starlette routes between OpenAI-style requests and the engine, nothing else.

Routes: POST /v1/completions and /v1/chat/completions (JSON, or SSE with
`stream: true`, ending `data: [DONE]`), GET /v1/models, GET /health (200 only
when ready; 503 `{"status": "loading" | "draining"}` otherwise), GET /metrics.

Every request gets an id: the `X-Request-Id` response header, the body's id
(`cmpl-<id>`, `chatcmpl-<id>`) and the first word of its log lines (the access
line here, the engine's telemetry line on `radianced.requests`).

Errors are OpenAI bodies (`{"error": {"message", "type", "param", "code"}}`):
400 malformed JSON or an invalid field (naming it) or prompt + max_tokens past
--max-model-len (stating both numbers); 401 missing or wrong bearer with
--api-key (on /v1/* only: /health and /metrics stay open for probes and
scrapers); 404 an unknown model or path; 413 a body over MAX_BODY_BYTES; 429
(with Retry-After) when --max-queue requests already wait; 503 while loading or
draining. A client that goes away has its request cancelled: a stream when a
write or the disconnect message tells us, a plain request through a watcher on
the connection; either way its blocks are back before the next step.

`ServerState` is the daemon's handle on all of this: it sets `phase` and
`served`, and waits on `wait_idle()` to drain.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from radianced.engine.driver import AsyncEngine, Chunk, EngineFailed, RequestStream
from radianced.engine.scheduler import QueueFull
from radianced.model.tokenizer import ChatTemplateError
from radianced.server import protocol as p
from radianced.server.metrics import Metrics

log = logging.getLogger("radianced.http")

# A body cap well above any real prompt: a 256K-token context is ~1.3 MB of text or
# ~1.8 MB of token ids as JSON; chat JSON escaping can double text. Past this, 413.
MAX_BODY_BYTES = 8 << 20
RETRY_AFTER_S = 1  # a queue slot frees when any request ends; a second is a fair first wait
CLIENT_GONE = 499  # nginx's status for "client closed the request"; only ever counted, never sent
# keys the template call itself passes: a request may not set them through chat_template_kwargs
_RESERVED_TEMPLATE_KEYS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


class Phase(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"


@dataclass(frozen=True)
class Served:
    """The loaded model as the routes need it."""

    engine: AsyncEngine
    name: str  # --served-model-name
    max_model_len: int
    defaults: dict[str, Any]  # generation_defaults(header.generation)
    vocab_size: int
    created: int = field(default_factory=lambda: int(time.time()))


class ServerState:
    """What the daemon and the routes share. Mutated on the event loop only."""

    def __init__(self, metrics: Metrics, api_key: str | None = None):
        self.metrics = metrics
        self.api_key = api_key
        self.phase = Phase.LOADING
        self.served: Served | None = None
        self.in_flight = 0  # HTTP requests between arrival and their last byte sent
        self._idle = asyncio.Event()
        self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no HTTP request is in flight."""
        await self._idle.wait()

    def _enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()


def build_app(state: ServerState) -> _RequestContext:
    """The ASGI app: the routes inside the request context."""
    routes = [
        Route("/v1/completions", _completions, methods=["POST"]),
        Route("/v1/chat/completions", _chat_completions, methods=["POST"]),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_exception, Exception: _server_error})
    app.state.radianced = state
    return _RequestContext(app, state)


# -- the request context: id, in-flight count, access log, status counter ------------


class _RequestContext:
    """ASGI wrapper: gives each request its id (scope state + X-Request-Id header),
    counts it in flight until its last byte is sent, and logs and counts its status."""

    def __init__(self, app: Starlette, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = secrets.token_hex(8)
        scope.setdefault("state", {})["request_id"] = rid
        status = 500
        start = time.perf_counter()

        async def send_with_id(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", rid.encode())]}
            await send(message)

        self.state._enter()
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.state._leave()
            path = scope["path"]
            if scope["state"].get("client_gone"):
                status = CLIENT_GONE
            if path.startswith("/v1/"):
                self.state.metrics.on_request_done(status)
            level = logging.INFO if path.startswith("/v1/") or status >= 400 else logging.DEBUG
            log.log(level, "%s: %s %s %d in %.0f ms", rid, scope["method"], path, status,
                    (time.perf_counter() - start) * 1e3)


# -- routes ---------------------------------------------------------------------------


async def _health(request: Request) -> Response:
    phase = _state(request).phase
    return _json({"status": phase.value}, 200 if phase is Phase.READY else 503)


async def _metrics(request: Request) -> Response:
    state = _state(request)
    if state.served is not None:
        sched = state.served.engine.scheduler
        state.metrics.set_running(sched.num_running)
        state.metrics.set_waiting(sched.num_waiting)
        state.metrics.set_kv_util(sched.kv_util)
    body, content_type = state.metrics.render()
    return Response(body, headers={"Content-Type": content_type})


async def _models(request: Request) -> Response:
    try:
        served = _admit(request)
    except p.ProtocolError as e:
        return _error(e)
    return Response(p.encode(p.model_list(served.name, served.created, served.max_model_len)),
                    media_type="application/json")


async def _completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def _chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def _generate(request: Request, chat: bool) -> Response:
    rid = request.state.request_id
    try:
        served = _admit(request)
        body = await _read_body(request)
        if chat:
            parsed = p.parse_chat(body, served.defaults)
        else:
            parsed = p.parse_completion(body, served.defaults, vocab_size=served.vocab_size)
        p.check_model(parsed.request, served.name)
        prompt_ids = _chat_prompt(served, parsed.request) if chat else _completion_prompt(served, parsed.request)
        params = p.fit_to_context(parsed, len(prompt_ids), served.max_model_len)
        try:
            stream = served.engine.submit(prompt_ids, params, rid)
        except QueueFull as e:
            raise p.ProtocolError(429, str(e)) from None
    except p.ProtocolError as e:
        return _error(e)
    except EngineFailed as e:
        return _error(p.ProtocolError(500, str(e)))
    except ClientDisconnect:  # gone while sending the body
        request.state.client_gone = True
        return Response(status_code=CLIENT_GONE)
    answer = _Answer(served, rid, chat, parsed.request, len(prompt_ids))
    if parsed.request.stream:
        return _EventStream(answer.events(stream), stream)
    return await _answer_whole(request, stream, answer)


async def _answer_whole(request: Request, stream: RequestStream, answer: _Answer) -> Response:
    """Run a non-streamed request while watching the connection; a client gone first cancels it."""
    work = asyncio.ensure_future(answer.collect(stream))
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        work.cancel()
        stream.close()
    if not work.done() or work.cancelled():
        request.state.client_gone = True
        return Response(status_code=CLIENT_GONE)  # nobody reads it
    try:
        return Response(p.encode(work.result()), media_type="application/json")
    except EngineFailed as e:
        return _error(p.ProtocolError(500, str(e)))


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- building the answer --------------------------------------------------------------


class _Answer:
    """Engine chunks -> one request's OpenAI response or SSE chunks (completions or chat)."""

    def __init__(self, served: Served, rid: str, chat: bool, req, prompt_tokens: int):
        self.rid = rid
        self.model = served.name
        self.tokenizer = served.engine.tokenizer
        self.chat = chat
        self.req = req
        self.prompt_tokens = prompt_tokens
        self.created = int(time.time())
        self.generated = 0
        self.text_len = 0  # characters of output so far (completions logprobs' text_offset)

    async def collect(self, stream: RequestStream):
        """The whole response (raises EngineFailed)."""
        texts, logprobs, reason = [], [], None
        async for chunk in stream:
            texts.append(chunk.text)
            logprobs += self._token_logprobs(chunk)
            self.generated += len(chunk.token_ids)
            reason = chunk.finish_reason
        text = "".join(texts)
        usage = p.usage(self.prompt_tokens, self.generated, stream.num_reused_tokens)
        if self.chat:
            lp = p.ChatLogprobs(content=[p.chat_token_logprob(*x) for x in logprobs]) if self.req.logprobs else None
            return p.chat_completion_response(self.rid, self.model, self.created, text, reason, usage, lp)
        return p.completion_response(self.rid, self.model, self.created, text, reason, usage,
                                     self._completion_logprobs(logprobs))

    async def events(self, stream: RequestStream):
        """SSE bytes: the chunks, the usage chunk if asked, `data: [DONE]`."""
        if self.chat:
            yield p.sse(p.chat_completion_chunk(self.rid, self.model, self.created, role="assistant", content=""))
        try:
            async for chunk in stream:
                self.generated += len(chunk.token_ids)
                event = self._chunk(chunk)
                if event is not None:
                    yield p.sse(event)
        except EngineFailed as e:
            log.error("%s: %s", self.rid, e)
            yield b"data: " + p.ProtocolError(500, str(e)).body() + b"\n\n"
        else:
            if self.req.include_usage:
                usage = p.usage(self.prompt_tokens, self.generated, stream.num_reused_tokens)
                build = p.chat_usage_chunk if self.chat else p.completion_usage_chunk
                yield p.sse(build(self.rid, self.model, self.created, usage))
        yield p.SSE_DONE

    def _chunk(self, chunk: Chunk):
        """The SSE chunk for one engine chunk, or None when it carries nothing to send."""
        logprobs = self._token_logprobs(chunk)
        if not chunk.text and not logprobs and chunk.finish_reason is None:
            return None  # held back (a split character, a possible stop string)
        if self.chat:
            lp = p.ChatLogprobs(content=[p.chat_token_logprob(*x) for x in logprobs]) if self.req.logprobs else None
            return p.chat_completion_chunk(self.rid, self.model, self.created, content=chunk.text or None,
                                           finish_reason=chunk.finish_reason, logprobs=lp)
        return p.completion_chunk(self.rid, self.model, self.created, chunk.text, chunk.finish_reason,
                                  self._completion_logprobs(logprobs))

    def _token_logprobs(self, chunk: Chunk) -> list[tuple[str, float, list[tuple[str, float]]]]:
        """(token text, logprob, [(top token text, logprob)]) per token of the chunk that has logprobs."""
        if chunk.logprobs is None or not chunk.token_ids:
            return []
        chosen, top = chunk.logprobs  # one token per step: (its logprob, [(id, logprob)] of the top-N)
        return [(self._piece(chunk.token_ids[0]), chosen, [(self._piece(i), lp) for i, lp in top])]

    def _completion_logprobs(self, logprobs) -> p.CompletionLogprobs | None:
        if self.req.logprobs is None:
            return None
        tokens = [t for t, _, _ in logprobs]
        out = p.completion_logprobs(tokens, [lp for _, lp, _ in logprobs], [top for _, _, top in logprobs],
                                    self.text_len)
        self.text_len += sum(len(t) for t in tokens)
        return out

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


class _EventStream(StreamingResponse):
    """An SSE response whose engine request is cancelled however the response ends."""

    def __init__(self, events, stream: RequestStream):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.stream.done:
                scope["state"]["client_gone"] = True
            self.stream.close()


# -- the request's way in ----------------------------------------------------------------


def _state(request: Request) -> ServerState:
    return request.app.state.radianced


def _admit(request: Request) -> Served:
    """The served model, or ProtocolError: 401 (bearer), 503 (loading, draining)."""
    state = _state(request)
    if state.api_key is not None:
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise p.ProtocolError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                                  "with the daemon's --api-key", code="invalid_api_key")
    if state.phase is Phase.LOADING or state.served is None:
        raise p.ProtocolError(503, "the model is still loading; retry when /health answers 200")
    if state.phase is Phase.DRAINING:
        raise p.ProtocolError(503, "the server is draining (shutting down) and takes no new requests")
    return state.served


async def _read_body(request: Request) -> bytes:
    """The body, or ProtocolError(413) past MAX_BODY_BYTES (refused before reading when
    Content-Length says so)."""
    too_big = p.ProtocolError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise too_big
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise too_big
    return bytes(body)


def _completion_prompt(served: Served, req: p.CompletionRequest) -> list[int]:
    if isinstance(req.prompt, list):
        return req.prompt
    ids = served.engine.tokenizer.encode(req.prompt, add_special_tokens=True)
    if not ids:
        raise p.ProtocolError(400, "the prompt encodes to no tokens", "prompt")
    return ids


def _chat_prompt(served: Served, req: p.ChatCompletionRequest) -> list[int]:
    kwargs = req.chat_template_kwargs or {}
    reserved = sorted(_RESERVED_TEMPLATE_KEYS & kwargs.keys())
    if reserved:
        raise p.ProtocolError(400, f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    tok = served.engine.tokenizer
    try:
        text = tok.apply_chat_template(req.template_messages(), add_generation_prompt=req.add_generation_prompt,
                                       **kwargs)
    except ChatTemplateError as e:
        raise p.ProtocolError(400, str(e), "messages") from None
    except (TypeError, ValueError, LookupError, AttributeError) as e:  # template code tripping on odd input
        raise p.ProtocolError(400, f"the chat template failed on these messages: {e}", "messages") from None
    ids = tok.encode(text)
    if not ids:
        raise p.ProtocolError(400, "the chat template renders these messages to no tokens", "messages")
    return ids


# -- responses ------------------------------------------------------------------------


def _json(obj: dict, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def _error(e: p.ProtocolError) -> Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else {}
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return Response(e.body(), status_code=e.status, headers=headers, media_type="application/json")


async def _server_error(request: Request, exc: Exception) -> Response:
    """A bug: an OpenAI body for the client (starlette re-raises it, and uvicorn logs the traceback)."""
    return Response(p.error_body(500, f"internal error ({type(exc).__name__}); the server log has the details"),
                    status_code=500, media_type="application/json")


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    """Starlette's own 404/405 as OpenAI error bodies."""
    message = {404: f"no route {request.url.path}; see /v1/completions, /v1/chat/completions, /v1/models",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
    return Response(p.error_body(exc.status_code, message), status_code=exc.status_code,
                    headers=exc.headers, media_type="application/json")
