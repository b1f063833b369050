"""The ASGI layer around the routes: each request's id, in-flight count, access log and status counter.

Every request gets an id: the `X-Request-Id` response header, the body's id
(`cmpl-<id>`, `chatcmpl-<id>`) and the first word of its log lines (the access
line here, the engine's telemetry line on `radianced.requests`). A request
whose client left (`scope["state"]["client_gone"]`) is counted as 499. The
daemon's own warm-up requests (server/self_warmup.py) are marked
(`scope["state"]["warm_up"]`: the routes admit them while loading), their ids say
"warm-up-http-", and they are not counted.
"""

from __future__ import annotations

import logging
import secrets
import time

from starlette.applications import Starlette
from starlette.datastructures import Headers

from radianced.server.state import ServerState

log = logging.getLogger("radianced.http")

CLIENT_GONE = 499  # nginx's status for "client closed the request"; only ever counted, never sent


class RequestContext:
    """ASGI wrapper: gives each request its id (scope state + X-Request-Id header),
    counts it in flight until its last byte is sent, and logs and counts its status."""

    def __init__(self, app: Starlette, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        warm_up = self.state.warm_up_token is not None and self.state.is_warm_up(Headers(scope=scope))
        rid = f"warm-up-http-{secrets.token_hex(4)}" if warm_up else secrets.token_hex(8)
        scope.setdefault("state", {}).update(request_id=rid, warm_up=warm_up)
        status = 500
        start = time.perf_counter()
        done = False

        def finish() -> None:
            nonlocal done, status
            done = True
            path = scope["path"]
            if scope["state"].get("client_gone"):
                status = CLIENT_GONE
            if path.startswith("/v1/") and not warm_up:
                self.state.engine.request_done(status)
            level = logging.INFO if path.startswith("/v1/") or status >= 400 else logging.DEBUG
            log.log(level, "%s: %s %s %d in %.0f ms", rid, scope["method"], path, status,
                    (time.perf_counter() - start) * 1e3)

        async def send_with_id(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", rid.encode())]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False) and not done:
                finish()  # before the last byte: a client that has its answer finds it logged and counted
            await send(message)

        self.state.enter()
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.state.leave()
            if not done:
                finish()
