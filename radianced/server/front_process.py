"""The daemon's side of its HTTP front: the front process started, its frames answered with the engine,
and the state the two share (the phase, the warm-up token, the HTTP requests in flight).

Why the HTTP work runs in a process of its own: on the H200 (session 26, bench/README), while a burst
of 8 prompts of 2,000 tokens arrived beside 4 decoding streams, one decode step's launch of 1.0-1.7 ms
of CPU took 7.8-12.7 ms of wall time. The step thread was never short of a core (its run-queue wait
was 0); it waited for the GIL, which the arrivals' HTTP work held: uvicorn's parser, starlette, the
route and the log lines, about 1.6 ms of Python a request. A priority gate on that work (a44d82b)
starved the streams instead. In the front process (server/front.py) that work shares no GIL with the
step thread; this process does, per request, a `Submit` frame decoded and `AsyncEngine.submit_to` and a
`RequestDone` counted, and per step one frame for each request that got tokens (each turn of the loop's
frames go in one write).

`Front.spawn` starts `python -P -m radianced.server.front` (the installed radianced, never one in the
working directory) in a process group of its own (a terminal's Ctrl-C is the daemon's to handle), with
the listening HTTP socket and one end of a socket pair (server/front_frames.py). If the front ends
unasked, `on_gone` says so at once (the daemon stops with status 1); once the daemon has sent `Exit`,
`stop` waits for it to end. The front's acknowledgements are waited for PHASE_ACK_S at most: a front
that stopped answering is taken as hung: no later phase waits for it, and `stop` kills it.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import socket
import subprocess
import sys
from collections.abc import Callable

from radianced.config import Config
from radianced.engine.driver import AsyncEngine
from radianced.engine.scheduler import QueueFull
from radianced.engine.streams import Chunk, EngineFailed, RequestFailed
from radianced.server import front_frames as f
from radianced.server.http_server import SHUTDOWN_GRACE_S
from radianced.server.metrics import Metrics
from radianced.server.state import Phase

log = logging.getLogger("radianced")

PHASE_ACK_S = 5.0  # the most a phase change waits for the front to take it
STOP_WAIT_S = SHUTDOWN_GRACE_S + 5.0  # after Exit: the front's graceful shutdown and its interpreter's exit


class Front:
    """The HTTP front as the daemon sees it: `phase`, `in_flight`, `wait_idle()`; `serve_model`,
    `set_phase` and `stop` tell it what changed. `engine` (once loaded) answers its requests."""

    def __init__(self, metrics: Metrics, on_gone: Callable[[str], None]):
        self.metrics = metrics
        self.engine: AsyncEngine | None = None
        self.phase = Phase.LOADING
        self.in_flight = 0  # HTTP requests the front was answering at its last phase change
        self.process: subprocess.Popen | None = None
        self._on_gone = on_gone
        self._conn: f.FrameConnection | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._asks = itertools.count()
        self._acks: dict[int, asyncio.Future] = {}
        self._exiting = False  # `stop` began, or the front has gone
        self._hung = False  # it did not take a phase within PHASE_ACK_S

    @classmethod
    async def spawn(cls, cfg: Config, api_key: str | None, http: socket.socket, metrics: Metrics,
                    on_gone: Callable[[str], None]) -> Front:
        """Start the front process serving `http` (the bound, listening socket: the front owns it from
        here, and this process's copy is closed). Raises OSError when it cannot be started."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        front = cls(metrics, on_gone)
        fds = (theirs.fileno(), http.fileno())
        try:
            front.process = subprocess.Popen([sys.executable, "-P", "-m", "radianced.server.front", *map(str, fds)],
                                             pass_fds=fds, stdin=subprocess.DEVNULL, process_group=0)
            await front.connect(ours, cfg, api_key)
        except BaseException:
            if front.process is not None:
                front.process.kill()
                front.process.wait()
            ours.close()
            raise
        finally:
            theirs.close()
            http.close()
        return front

    async def connect(self, sock: socket.socket, cfg: Config, api_key: str | None) -> None:
        """Speak over `sock` (one end of a pair whose other end a front reads: `spawn`'s process, or an
        `EngineClient` in this process in tests) and send it the flags."""
        self._conn = f.FrameConnection(self._take, self._closed)
        await self._conn.open(sock)
        self._conn.send(f.Start(cfg, api_key))

    # -- what the daemon tells the front --------------------------------------------------

    def serve_model(self, engine: AsyncEngine, name: str, max_model_len: int, defaults: dict,
                    vocab_size: int) -> None:
        """The model is loaded: the front may route requests to `engine` (its warm-up's first; the
        rest once the phase is ready)."""
        self.engine = engine
        tok = engine.tokenizer
        if self._conn is not None:
            self._conn.send(f.ServedModel(name, max_model_len, defaults, vocab_size, tok.tokenizer_json,
                                          tok.chat_template, tok.bos_token_id, list(tok.eos_token_ids)))

    async def set_phase(self, phase: Phase, warm_up_token: str | None = None) -> None:
        """Set the phase (and the token the daemon's own warm-up requests carry); returns once the front
        has it, so that a client told what follows (systemd's READY=1) finds it so, or after PHASE_ACK_S."""
        if self._conn is not None and not self._exiting and not self._hung:
            ask = next(self._asks)
            acked = self._acks[ask] = asyncio.get_running_loop().create_future()
            self._conn.send(f.PhaseSet(phase.value, warm_up_token, ask))
            try:
                await asyncio.wait_for(acked, PHASE_ACK_S)
            except asyncio.TimeoutError:
                self._acks.pop(ask, None)
                self._hung = True
                log.warning("the HTTP front did not take the phase %r within %g s: it is taken as hung (it is "
                            "stopped without waiting)", phase.value, PHASE_ACK_S)
        self.phase = phase

    async def wait_idle(self) -> None:
        """Return once the front answers no HTTP request (or has gone)."""
        await self._idle.wait()

    async def stop(self) -> None:
        """Tell the front to exit (its open responses get SHUTDOWN_GRACE_S to finish) and wait for it."""
        self._exiting = True
        if self._conn is not None:
            self._conn.send(f.Exit())
        if self.process is not None:
            if self._hung:
                self.process.kill()
            try:
                status = await asyncio.to_thread(self.process.wait, STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                log.warning("the HTTP front did not exit within %g s; killing it", STOP_WAIT_S)
                self.process.kill()
                status = await asyncio.to_thread(self.process.wait)
            if status != 0:
                log.warning("the HTTP front exited with status %d", status)
        if self._conn is not None:
            self._conn.close()

    # -- what the front asks --------------------------------------------------------------

    def _take(self, frame: f.Frame) -> None:
        if isinstance(frame, f.Submit):
            self._submit(frame)
        elif isinstance(frame, f.Cancel):
            if self.engine is not None:
                self.engine.cancel(frame.rid)
        elif isinstance(frame, f.RequestDone):
            self.metrics.on_request_done(frame.status)
        elif isinstance(frame, f.InFlight):
            self._idle.clear() if frame.busy else self._idle.set()
        elif isinstance(frame, f.AskMetrics):
            self._conn.send(f.MetricsText(frame.ask, *self._render()))
        elif isinstance(frame, f.Ping):
            self._conn.send(f.Ack(frame.ask))
        elif isinstance(frame, f.Ack):
            self.in_flight = frame.in_flight
            if (done := self._acks.pop(frame.ask, None)) is not None and not done.done():
                done.set_result(None)
        else:
            raise TypeError(f"the HTTP front sent {type(frame).__name__}, which only the daemon sends")

    def _submit(self, frame: f.Submit) -> None:
        try:
            if self.engine is None:
                raise EngineFailed("the model is not loaded")
            self.engine.submit_to(frame.prompt_ids, frame.params, functools.partial(self._deliver, frame.rid),
                                  frame.rid)
        except QueueFull as e:
            self._conn.send(f.Refused(frame.rid, 429, str(e)))
            return
        except EngineFailed as e:
            self._conn.send(f.Refused(frame.rid, 500, str(e)))
            return
        except Exception as e:  # a bug: this request's 500, the daemon's log has the traceback
            log.exception("%s: could not be queued", frame.rid)
            self._conn.send(f.Refused(frame.rid, 500, f"internal error ({type(e).__name__}); the server log has "
                                                      "the details"))
            return
        self.engine.trace.http(frame.arrived, frame.rid, frame.read_s, frame.prepare_s)
        self._conn.send(f.Accepted(frame.rid))

    def _deliver(self, rid: str, item: Chunk | BaseException) -> None:
        """A request's chunk, or its failure, to the front."""
        if self._conn is None:
            return
        if isinstance(item, Chunk):
            self._conn.send(f.Output(rid, item))
        elif isinstance(item, RequestFailed):
            self._conn.send(f.Failed(rid, str(item), engine=False))
        else:
            self._conn.send(f.Failed(rid, f"the engine failed: {item!r}", engine=True))

    def _render(self) -> tuple[bytes, str]:
        if self.engine is not None:
            sched = self.engine.scheduler
            self.metrics.set_running(sched.num_running)
            self.metrics.set_waiting(sched.num_waiting)
            self.metrics.set_kv_util(sched.kv_util)
        return self.metrics.render()

    def _closed(self) -> None:
        """The front's end closed: asked (after `Exit`), or its process ended."""
        self._conn = None
        self._idle.set()
        for done in self._acks.values():
            if not done.done():
                done.set_result(None)
        self._acks.clear()
        if not self._exiting:
            self._exiting = True
            code = self.process.poll() if self.process is not None else None
            self._on_gone("the HTTP front process ended" + (f" (status {code})" if code is not None else ""))
