"""The HTTP API: starlette routes between OpenAI-style requests and the engine, nothing else.

They run in the HTTP front process (server/front.py); the engine is the daemon's, reached through
`ServerState.engine` (server/engine_client.py).

Routes: POST /v1/completions and /v1/chat/completions (JSON, or SSE with
`stream: true`, ending `data: [DONE]`), GET /v1/models, GET /health (200 only
when ready and the daemon's loop answers the front within HEALTH_ANSWER_S;
503 `{"status": "loading" | "draining" | "unresponsive"}` otherwise), GET
/metrics (the daemon's registry).
Each request runs inside `RequestContext` (request_context.py: its id, the
in-flight count, the access log). The loop only reads the body: decoding,
checking, the chat template and tokenizing run on a worker thread
(prompts.prepare), so /health and the streams never wait on one request's
input. The answer is built by `Answer` (answers.py).

Errors are OpenAI bodies (`{"error": {"message", "type", "param", "code"}}`):
400 malformed JSON or an invalid field (naming it) or a prompt past
--max-model-len (stating both numbers; limits.py has every limit); 401 missing
or wrong bearer with an API key set (on /v1/* only: /health and /metrics stay
open for probes and scrapers); 404 an unknown model or path; 408 a body still
arriving after --timeout-body; 413 a body over MAX_BODY_BYTES; 415 a body
declared as something other than JSON; 429 (with Retry-After) when --max-queue
requests wait beyond the free sequence slots; 503 while loading or draining
(a body still arriving when the drain begins included). A client that goes
away has its request cancelled: a stream when a write or the disconnect
message tells us, a plain request through a watcher on the connection; either
way its blocks are back before the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import time

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from radianced.engine.streams import EngineFailed, RequestStream
from radianced.server.answers import Answer, EventStream
from radianced.server.api_errors import ProtocolError, error_body
from radianced.server.api_responses import encode, model_list
from radianced.server.limits import MAX_BODY_BYTES
from radianced.server.prompts import prepare
from radianced.server.request_context import CLIENT_GONE, RequestContext
from radianced.server.state import Phase, Served, ServerState

RETRY_AFTER_S = 1  # a queue slot frees when any request ends; a second is a fair first wait
HEALTH_ANSWER_S = 2.0  # /health is 503 "unresponsive" when the daemon's loop has not answered in this long


def build_app(state: ServerState) -> RequestContext:
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
    return RequestContext(app, state)


# -- routes ---------------------------------------------------------------------------


async def _health(request: Request) -> Response:
    state = _state(request)
    phase = state.phase
    if phase is Phase.READY and not await state.engine.answers(HEALTH_ANSWER_S):
        return _json({"status": "unresponsive"}, 503)
    return _json({"status": phase.value}, 200 if phase is Phase.READY else 503)


async def _metrics(request: Request) -> Response:
    try:
        body, content_type = await _state(request).engine.metrics()  # the daemon's registry
    except ProtocolError as e:
        return _error(e)
    return Response(body, headers={"Content-Type": content_type})


async def _models(request: Request) -> Response:
    try:
        served = _admit(request)
    except ProtocolError as e:
        return _error(e)
    return Response(encode(model_list(served.name, served.created, served.max_model_len)),
                    media_type="application/json")


async def _completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def _chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def _generate(request: Request, chat: bool) -> Response:
    rid = request.state.request_id
    state = _state(request)
    t0 = time.perf_counter()
    try:
        served = _admit(request)
        _check_content_type(request)
        body = await _read_body(request, state)
        t1 = time.perf_counter()
        ready = await asyncio.get_running_loop().run_in_executor(state.prepare_pool, prepare, served, body, chat)
        stream = await served.engine.submit(ready.prompt_ids, ready.params, rid, t0, t1 - t0,
                                            time.perf_counter() - t1)
    except ProtocolError as e:
        return _error(e)
    except ClientDisconnect:  # gone while sending the body
        request.state.client_gone = True
        return Response(status_code=CLIENT_GONE)
    req = ready.parsed.request
    answer = Answer(served, rid, chat, req, len(ready.prompt_ids))
    if req.stream:
        return EventStream(answer.events(stream), stream)
    return await _answer_whole(request, stream, answer)


async def _answer_whole(request: Request, stream: RequestStream, answer: Answer) -> Response:
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
        return Response(encode(work.result()), media_type="application/json")
    except EngineFailed as e:
        return _error(ProtocolError(500, str(e)))


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
            raise ProtocolError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                                "with the daemon's key", code="invalid_api_key")
    warm_up = request.scope["state"].get("warm_up", False)  # the daemon's own (request_context.py)
    if (state.phase is Phase.LOADING and not warm_up) or state.served is None:
        raise ProtocolError(503, "the model is still loading; retry when /health answers 200")
    if state.phase is Phase.DRAINING:
        raise ProtocolError(503, "the server is draining (shutting down) and takes no new requests")
    return state.served


def _check_content_type(request: Request) -> None:
    """ProtocolError(415) unless the body is declared JSON, or not declared at all (curl
    without -H, httpx's content=). Refusing text/plain and forms also keeps a web page
    from posting to the API cross-origin: browsers send those without asking first."""
    given = request.headers.get("content-type", "")
    if given.strip() and given.split(";")[0].strip().lower() != "application/json":
        raise ProtocolError(415, f"Content-Type {given!r}: the body must be JSON; send the header "
                            "'Content-Type: application/json' (or none)")


async def _read_body(request: Request, state: ServerState) -> bytes:
    """The body, or ProtocolError: 413 past MAX_BODY_BYTES (refused before reading when
    Content-Length says so), 408 when it has not all arrived after --timeout-body seconds,
    503 when the drain begins while it arrives (the request was never queued: retry it)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise _too_big()
    reading = asyncio.ensure_future(_read_all(request))
    draining = asyncio.ensure_future(state.draining.wait())
    try:
        await asyncio.wait((reading, draining), timeout=state.body_timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        draining.cancel()
        if not reading.done():
            reading.cancel()
    if reading.done() and not reading.cancelled():
        return reading.result()
    if state.draining.is_set():
        raise ProtocolError(503, "the server began shutting down while this request's body was arriving; the "
                            "request was not run: send it again (to another server, or once this one is back)")
    raise ProtocolError(408, f"the request body did not arrive within {state.body_timeout_s:g} s (--timeout-body); "
                        "send it whole, or raise --timeout-body for a slow link")


async def _read_all(request: Request) -> bytes:
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise _too_big()
    return bytes(body)


def _too_big() -> ProtocolError:
    return ProtocolError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")


# -- responses ------------------------------------------------------------------------


def _json(obj: dict, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def _error(e: ProtocolError) -> Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else {}
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if e.status in (408, 503):  # the body may be half read: this connection cannot carry another request
        headers["Connection"] = "close"
    return Response(e.body(), status_code=e.status, headers=headers, media_type="application/json")


async def _server_error(request: Request, exc: Exception) -> Response:
    """A bug: an OpenAI body for the client (starlette re-raises it, and uvicorn logs the traceback)."""
    return Response(error_body(500, f"internal error ({type(exc).__name__}); the server log has the details"),
                    status_code=500, media_type="application/json")


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    """Starlette's own 404/405 as OpenAI error bodies."""
    message = {404: f"no route {request.url.path}; see /v1/completions, /v1/chat/completions, /v1/models",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
    return Response(error_body(exc.status_code, message), status_code=exc.status_code,
                    headers=exc.headers, media_type="application/json")
