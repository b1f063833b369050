"""The HTTP server under the routes: the listening socket, and uvicorn inside the HTTP front's loop.

`listen(cfg)` binds, in the daemon, before anything loads, so a taken port fails
at once; `HttpServer` is uvicorn serving that socket on the front's event loop
(server/front.py), with the daemon, not uvicorn, owning SIGTERM and SIGINT (the
drain: the front ignores both and exits when the daemon says so).

Slow clients are cut off: an idle keep-alive connection after
--timeout-keep-alive (uvicorn's own timer), a request whose line and headers
have not all arrived after --timeout-headers (`_HeadTimeoutH11`: uvicorn has no
such timer, so a client that connected and sent nothing, or a header a byte at
a time, held its connection forever), and a body after --timeout-body
(http.py, in the ASGI layer).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import stat

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from radianced.config import Config
from radianced.server.api_errors import error_body

log = logging.getLogger("radianced")

SHUTDOWN_GRACE_S = 5.0  # after the drain: cancelled responses write their last bytes


class HttpServer(uvicorn.Server):
    """uvicorn inside the front's loop: the daemon, not uvicorn, owns SIGTERM and SIGINT (the drain)."""

    def __init__(self, app, cfg: Config):
        protocol = functools.partial(_HeadTimeoutH11, head_timeout_s=cfg.timeout_headers)
        super().__init__(uvicorn.Config(app, loop="none", lifespan="off", http=protocol, ws="none", log_config=None,
                                        access_log=False, server_header=False,
                                        timeout_keep_alive=cfg.timeout_keep_alive,
                                        timeout_graceful_shutdown=SHUTDOWN_GRACE_S))

    def capture_signals(self):
        return contextlib.nullcontext()


class _HeadTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's head (request line and headers).

    The timer runs from the connection's start, and from a later request's first byte
    (between requests uvicorn's keep-alive timer runs), until the head is whole. When it
    fires, a partial head is answered 408 with a JSON body; a connection that sent
    nothing is closed.
    """

    def __init__(self, *args, head_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_timeout_s = head_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = False  # bytes of a head arrived since the timer started

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._watch_head()

    def data_received(self, data: bytes) -> None:
        waiting = self._head_timer is not None or self.conn.their_state is h11.IDLE
        super().data_received(data)
        self._head_bytes = self._head_bytes or waiting
        self._watch_head()

    def connection_lost(self, exc) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _watch_head(self) -> None:
        """Start the timer when a head is awaited with bytes of it in (or none yet on a new
        connection); stop it when the head is whole."""
        awaited = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if not awaited:
            self._stop_head_timer()
        elif self._head_timer is None and (self._head_bytes or self.cycle is None):
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._head_bytes = False

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if self._head_bytes:
            body = error_body(408, f"the request line and headers did not arrive within {self.head_timeout_s:g} s "
                                   f"(--timeout-headers)")
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            log.info("closed a connection whose request head was still arriving after %g s (--timeout-headers)",
                     self.head_timeout_s)
        self.transport.close()


def listen(cfg: Config) -> socket.socket:
    """The bound, listening HTTP socket: --http-socket PATH (instead of TCP), else --host/--port.
    Logs where it listens (port 0 picks a free port)."""
    if cfg.http_socket:
        path = cfg.http_socket
        _remove_stale_socket(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        os.chmod(path, 0o660)  # the runtime directory (0750) decides who reaches it
        sock.listen(2048)
        log.info("serving HTTP on unix:%s", path)
        return sock
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    sock = socket.create_server((cfg.host, cfg.port), family=family, backlog=2048)
    host, port = sock.getsockname()[:2]
    log.info("serving HTTP on http://%s:%d", f"[{host}]" if family == socket.AF_INET6 else host, port)
    return sock


def _remove_stale_socket(path: str) -> None:
    """Unlink a socket file nobody listens on (left by a daemon that died); refuse a live one."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(f"--http-socket {path}: exists and is not a socket; remove it or choose another path")
    except FileNotFoundError:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)
            return
    raise OSError(f"--http-socket {path}: another process is listening there")
