"""The daemon's front link (server/front_process.Front) and the front's engine client
(server/engine_client.EngineClient) over one socket pair, both in this process: the routes
(`build_app(client.state)`) reach an in-process engine through the real frames."""

from __future__ import annotations

import socket

from radianced.config import Config
from radianced.engine.driver import AsyncEngine
from radianced.server.engine_client import EngineClient
from radianced.server.front_process import Front
from radianced.server.metrics import Metrics
from radianced.server.state import Phase


async def front_pair(engine: AsyncEngine | None, metrics: Metrics | None = None, name: str = "m",
                     max_model_len: int = 256, vocab_size: int = 400, cfg: Config | None = None,
                     on_gone=None) -> tuple[Front, EngineClient]:
    """(the daemon's end, the front's end), started; with `engine`, its model served (still loading)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    front = Front(metrics or Metrics(), on_gone or (lambda line: None))
    client = EngineClient()
    await client.connect(theirs)
    await front.connect(ours, cfg or Config(), None)
    await client.started
    if engine is not None:
        front.serve_model(engine, name, max_model_len, {}, vocab_size)
    await front.set_phase(Phase.LOADING)  # a round trip: what was sent before is taken
    return front, client
