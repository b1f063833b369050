"""The HTTP server under the routes: the listening socket and uvicorn inside the daemon's loop.

`listen(cfg)` binds before anything loads, so a taken port fails at once;
`HttpServer` is uvicorn serving that socket on the daemon's event loop, with
the daemon, not uvicorn, owning SIGTERM and SIGINT (the drain).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat

import uvicorn

from radianced.config import Config

log = logging.getLogger("radianced")

SHUTDOWN_GRACE_S = 5.0  # after the drain: cancelled responses write their last bytes


class HttpServer(uvicorn.Server):
    """uvicorn inside our loop: the daemon, not uvicorn, owns SIGTERM and SIGINT (the drain)."""

    def __init__(self, app):
        super().__init__(uvicorn.Config(app, loop="none", lifespan="off", http="h11", ws="none", log_config=None,
                                        access_log=False, server_header=False,
                                        timeout_graceful_shutdown=SHUTDOWN_GRACE_S))

    def capture_signals(self):
        return contextlib.nullcontext()


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
