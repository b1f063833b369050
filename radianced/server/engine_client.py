"""The engine as the HTTP front's routes reach it: over the socket pair to the daemon's process
(server/front_frames.py; the daemon's side is server/front_process.py).

`submit` sends a request and returns its `RequestStream` once the daemon has queued it (or raises
ProtocolError: 429 with the queue full, 500 when the engine failed or its process ended); the
stream's chunks arrive as `Output` frames into its queue, as a stream's do in the daemon's process.
Leaving a stream early sends `Cancel`. The frames that set the front's state (`ServedModel`,
`PhaseSet`) change the `ServerState` the routes read; `exited` resolves on `Exit`, or when the
daemon's end closes (its process ended: every live stream then fails).
"""

from __future__ import annotations

import asyncio
import gc
import itertools

from radianced.engine.sampling_params import SamplingParams
from radianced.engine.streams import EngineFailed, RequestFailed, RequestStream
from radianced.model.tokenizer import Tokenizer
from radianced.server import front_frames as f
from radianced.server.api_errors import ProtocolError
from radianced.server.state import Phase, Served, ServerState

GONE = "the engine's process (the daemon) has ended"


class EngineClient:
    """The front's end of the pair. `state` is made from the daemon's `Start` frame (`started`)."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.state: ServerState | None = None
        self.tokenizer: Tokenizer | None = None
        self.started: asyncio.Future = loop.create_future()  # the Start frame
        self.exited: asyncio.Future = loop.create_future()  # True: asked to (Exit); False: the daemon's end closed
        self._conn: f.FrameConnection | None = None
        self._queues: dict[str, asyncio.Queue] = {}  # live requests' chunks
        self._pending: dict[str, asyncio.Future] = {}  # submitted, not yet answered Accepted/Refused
        self._asks = itertools.count()
        self._metrics: dict[int, asyncio.Future] = {}
        self._acks: dict[int, asyncio.Future] = {}  # pings

    async def connect(self, sock) -> None:
        self._conn = f.FrameConnection(self._take, self._closed)
        await self._conn.open(sock)

    # -- what the routes call -----------------------------------------------------------------

    async def submit(self, prompt_ids: list[int], params: SamplingParams, rid: str, arrived: float,
                     read_s: float, prepare_s: float) -> RequestStream:
        """Queue a request in the engine; its stream. Raises ProtocolError (429, 500)."""
        if self._conn is None:
            raise ProtocolError(500, GONE)
        answer = self._pending[rid] = asyncio.get_running_loop().create_future()
        queue = self._queues[rid] = asyncio.Queue()
        try:
            self._conn.send(f.Submit(rid, prompt_ids, params, arrived, read_s, prepare_s))
            refused = await answer
        except BaseException:
            self._pending.pop(rid, None)
            self.cancel(rid)
            raise
        if refused is not None:
            del self._queues[rid]
            raise ProtocolError(refused.status, refused.message)
        return RequestStream(rid, queue, self.cancel)

    def cancel(self, rid: str) -> None:
        """End a request early (its client left, or its stream was closed)."""
        if self._queues.pop(rid, None) is not None and self._conn is not None:
            self._conn.send(f.Cancel(rid))

    def request_done(self, status: int) -> None:
        """Count an answered /v1/ request by its HTTP status (the daemon's radiance_requests_total)."""
        if self._conn is not None:
            self._conn.send(f.RequestDone(status))

    def busy(self, busy: bool) -> None:
        """Whether some HTTP request is being answered (when that changes: the daemon's drain waits for none)."""
        if self._conn is not None:
            self._conn.send(f.InFlight(busy))

    async def answers(self, timeout_s: float) -> bool:
        """Whether the daemon's loop answers a `Ping` within `timeout_s` (/health)."""
        if self._conn is None:
            return False
        ask = next(self._asks)
        done = self._acks[ask] = asyncio.get_running_loop().create_future()
        self._conn.send(f.Ping(ask))
        try:
            await asyncio.wait_for(done, timeout_s)
        except (asyncio.TimeoutError, ProtocolError):
            return False
        finally:
            self._acks.pop(ask, None)
        return True

    async def metrics(self) -> tuple[bytes, str]:
        """The daemon's /metrics text and its content type. Raises ProtocolError(500) once it has gone."""
        if self._conn is None:
            raise ProtocolError(500, GONE)
        ask = next(self._asks)
        done = self._metrics[ask] = asyncio.get_running_loop().create_future()
        self._conn.send(f.AskMetrics(ask))
        text = await done
        return text.body, text.content_type

    # -- what the daemon sends ------------------------------------------------------------------

    def _take(self, frame: f.Frame) -> None:
        if isinstance(frame, f.Output):
            if (queue := self._queues.get(frame.rid)) is not None:  # else: cancelled here meanwhile
                queue.put_nowait(frame.chunk)
                if frame.chunk.finish_reason is not None:
                    del self._queues[frame.rid]
        elif isinstance(frame, (f.Accepted, f.Refused)):
            if (answer := self._pending.pop(frame.rid, None)) is not None and not answer.done():
                answer.set_result(frame if isinstance(frame, f.Refused) else None)
        elif isinstance(frame, f.Failed):
            if (queue := self._queues.pop(frame.rid, None)) is not None:
                queue.put_nowait((EngineFailed if frame.engine else RequestFailed)(frame.message))
        elif isinstance(frame, f.MetricsText):
            if (done := self._metrics.pop(frame.ask, None)) is not None and not done.done():
                done.set_result(frame)
        elif isinstance(frame, f.Ack):
            if (done := self._acks.pop(frame.ask, None)) is not None and not done.done():
                done.set_result(None)
        elif isinstance(frame, f.PhaseSet):
            self.state.phase = Phase(frame.phase)
            self.state.warm_up_token = frame.warm_up_token
            if self.state.phase is Phase.READY:  # the start-up heap, never scanned again (as the daemon's)
                gc.collect()
                gc.freeze()
            self._conn.send(f.Ack(frame.ask, self.state.in_flight))
        elif isinstance(frame, f.ServedModel):
            self.tokenizer = Tokenizer(frame.tokenizer_json, frame.chat_template, frame.bos_token_id,
                                       frame.eos_token_ids)
            self.state.served = Served(self, frame.name, frame.max_model_len, frame.defaults, frame.vocab_size)
        elif isinstance(frame, f.Start):
            self.state = ServerState(self, api_key=frame.api_key, body_timeout_s=frame.config.timeout_body)
            self.started.set_result(frame.config)
        elif isinstance(frame, f.Exit):
            if not self.exited.done():
                self.exited.set_result(True)
        else:
            raise TypeError(f"the daemon sent {type(frame).__name__}, which only the front sends")

    def _closed(self) -> None:
        """The daemon's end closed: every live request fails, the front exits."""
        self._conn = None
        gone = EngineFailed(GONE)
        for queue in self._queues.values():
            queue.put_nowait(gone)
        self._queues.clear()
        for waiting in (*self._pending.values(), *self._metrics.values(), *self._acks.values()):
            if not waiting.done():
                waiting.set_exception(ProtocolError(500, GONE))
        self._pending.clear()
        self._metrics.clear()
        self._acks.clear()
        if not self.started.done():
            self.started.set_exception(ConnectionError(GONE))
        if not self.exited.done():
            self.exited.set_result(False)
