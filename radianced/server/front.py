"""The HTTP front process: uvicorn and the routes, with the engine in the daemon's process.

    python -m radianced.server.front PAIR_FD HTTP_FD

The daemon (server/front_process.py says why the HTTP work runs apart from the step thread) starts it
with the listening HTTP socket and its end of a socket pair, then sends the flags (`Start`), the model
once loaded, and each phase. This process never loads torch: the tokenizer, the chat template, the
detokenized text's SSE events and the access log are its work. It runs in a process group of its own
(a terminal's Ctrl-C reaches the daemon only) and ignores SIGINT and SIGTERM besides: the daemon owns
the drain. It exits when the daemon says `Exit` (0), or when the daemon's end closes unasked (1: the
daemon died; nothing is left to serve).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys

import uvloop

from radianced.server.engine_client import EngineClient
from radianced.server.http import build_app
from radianced.server.http_server import HttpServer
from radianced.server.log_writer import logs_off_the_loop
from radianced.server.state import Phase

log = logging.getLogger("radianced.front")


def main(argv: list[str]) -> int:
    pair, http = (socket.socket(fileno=int(fd)) for fd in argv)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    with logs_off_the_loop(sys.stderr):
        return uvloop.run(_serve(pair, http))


async def _serve(pair: socket.socket, http: socket.socket) -> int:
    client = EngineClient()
    await client.connect(pair)
    try:
        config = await client.started
    except ConnectionError:
        return 1
    state = client.state
    server = HttpServer(build_app(state), config)
    serving = asyncio.create_task(server.serve(sockets=[http]))
    await asyncio.wait((client.exited, serving), return_when=asyncio.FIRST_COMPLETED)
    asked = client.exited.done() and client.exited.result()
    if not asked:
        log.error("the daemon's process ended: the HTTP front exits" if client.exited.done()
                  else "the HTTP server stopped unasked")
    state.phase = Phase.DRAINING
    server.should_exit = True
    await serving
    return 0 if asked else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
