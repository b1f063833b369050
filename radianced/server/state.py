"""What the HTTP front's routes share: the phase, the served model, the requests in flight.

The daemon sets `phase` and `served` through the front's `EngineClient` (server/engine_client.py:
the frames of server/front_process.py); the routes read them, and the request context counts each
request in flight until its last byte is sent, which the daemon's drain waits on.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radianced.server.self_warmup import WARM_UP_HEADER

if TYPE_CHECKING:
    from radianced.server.engine_client import EngineClient


class Phase(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"


@dataclass(frozen=True)
class Served:
    """The loaded model as the routes need it."""

    engine: EngineClient  # its tokenizer, submit and cancel
    name: str  # --served-model-name
    max_model_len: int
    defaults: dict[str, Any]  # generation_defaults(header.generation)
    vocab_size: int
    created: int = field(default_factory=lambda: int(time.time()))


class ServerState:
    """What the routes share. Mutated on the front's event loop only. `engine`: the daemon's engine
    (told when requests are in flight and when none is: the drain waits for none).

    body_timeout_s: the seconds a request's whole body may take to arrive (--timeout-body;
    None: no limit). `prepare_pool` runs the work between a body and the engine
    (prompts.prepare) off the loop; two threads, as tokenizing competes with the step
    thread for the cores.
    """

    PREPARE_THREADS = 2

    def __init__(self, engine: EngineClient, api_key: str | None = None, body_timeout_s: float | None = None):
        self.engine = engine
        self.api_key = api_key
        self.body_timeout_s = body_timeout_s
        self.served: Served | None = None
        self.warm_up_token: str | None = None  # while set, requests carrying it are the daemon's own (self_warmup)
        self.in_flight = 0  # HTTP requests between arrival and their last byte sent
        self.prepare_pool = ThreadPoolExecutor(self.PREPARE_THREADS, thread_name_prefix="radianced-prepare")
        self.draining = asyncio.Event()  # set with phase DRAINING: bodies still arriving are answered 503
        self._phase = Phase.LOADING

    @property
    def phase(self) -> Phase:
        return self._phase

    @phase.setter
    def phase(self, phase: Phase) -> None:
        self._phase = phase
        if phase is Phase.DRAINING:
            self.draining.set()

    def is_warm_up(self, headers) -> bool:
        """Whether a request with these headers is one of the daemon's own warm-up requests
        (server/self_warmup.py): it carries the token while the token is set."""
        given = headers.get(WARM_UP_HEADER)
        return (self.warm_up_token is not None and given is not None
                and hmac.compare_digest(given.encode(), self.warm_up_token.encode()))

    def enter(self) -> None:
        """One more request in flight (the request context calls it on arrival)."""
        self.in_flight += 1
        if self.in_flight == 1:
            self.engine.busy(True)

    def leave(self) -> None:
        """One request fewer in flight (after its last byte was sent)."""
        self.in_flight -= 1
        if self.in_flight == 0:
            self.engine.busy(False)
