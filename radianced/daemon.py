"""The daemon: a uvloop process serving the control socket and the engine, and its HTTP front process.

Start-up, in order: bind the HTTP socket (a taken port fails at once, before
any loading), start the HTTP front process on it (server/front.py; why it is a
process of its own: server/front_process.py), which answers /health 503
"loading", open the control socket, load the model on a thread while telling systemd EXTEND_TIMEOUT_USEC,
start the engine task, serve the warm-up requests (through the engine, then
through the daemon's own HTTP socket: engine/warmup.py, server/self_warmup.py),
then READY=1. A watchdog task sends WATCHDOG=1 (when
systemd set WATCHDOG_USEC for this process) only while the engine makes
progress or has nothing to do.

Stop: SIGTERM, SIGINT or `radiancectl drain` stops admitting (new requests and
/health get 503), lets in-flight requests finish for up to --drain-timeout,
cancels what is left (those streams still end with `[DONE]`, finish_reason
"abort"), closes the sockets and exits 0. A second SIGINT skips the wait; a
signal once the loop has closed changes nothing (the status stays). A
fatal engine error fails the live requests (500) and exits 1, so systemd
restarts the unit; so does any start-up failure, with one line saying why.

Environment: RADIANCED_CPU_THREADS=N sets torch's CPU threads (default on the CPU
backend: every usable core, OpenMP's idle threads spinning only briefly; tests use 1).
RADIANCED_STEP_TRACE=FILE appends the step thread's rounds and the loop's arrivals
and dispatches to FILE, one JSON line each (engine/step_trace.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path

from radianced import cpu_threads

UNBOUND = cpu_threads.prepare_openmp()  # before the imports below load torch and its libgomp, which reads it once

import uvloop

from radianced.budget import PlanError
from radianced.card import Card
from radianced.config import Config, ConfigError
from radianced.engine import drafting_cost, step_trace
from radianced.engine.driver import AsyncEngine, step_executor
from radianced.engine.pacing import StepPacer
from radianced.engine.step_trace import StepTrace
from radianced.engine.tp_memory import refuse_device
from radianced.engine.tp_processes import RankWorkers
from radianced.engine.warmup import warm_up_served, warm_up_start
from radianced.handoff import call_into
from radianced.kernels.compiles import CompileLog
from radianced.model.config import UnsupportedModel
from radianced.model.parallel import SINGLE, Group
from radianced.model.rad import RadFile
from radianced.model.rad_format import RadError
from radianced.server import control, notify
from radianced.server.api_key import ApiKeyError, load_api_key
from radianced.server.api_requests import generation_defaults
from radianced.server.control_handlers import ControlHandlers
from radianced.server.front_process import Front
from radianced.server.http_server import SHUTDOWN_GRACE_S, listen
from radianced.server.limits import max_prompt_bytes
from radianced.server.log_writer import logs_off_the_loop
from radianced.server.metrics import Metrics
from radianced.server.self_warmup import address_of, warm_up_http
from radianced.server.state import Phase
from radianced.tiers.host import HostPoolError
from radianced.tiers.live_profile import LiveProfile
from radianced.tiers.profile import ProfileError

log = logging.getLogger("radianced")

EXTEND_EVERY_S = 5.0  # while loading, ask systemd for EXTEND_S more seconds this often
EXTEND_S = 20.0
STOP_EXTRA_S = 20.0  # asked for beyond --drain-timeout when the stop begins (streams' grace, the front's exit)
_LOAD_ERRORS = (RadError, FileNotFoundError, PlanError, ConfigError, UnsupportedModel, OSError, HostPoolError,
                ProfileError)


def main(cfg: Config) -> int:
    """Run the daemon until it is stopped; the process exit status."""
    with logs_off_the_loop(sys.stderr):
        return uvloop.run(Daemon(cfg).run())


class Daemon:
    """The process's state and life; the control socket's handlers read it (server/control_handlers.py)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.metrics = Metrics(kv_dtype=cfg.kv_cache_dtype)
        self.front: Front | None = None  # the HTTP front process, once started
        self.api_key: str | None = None
        self.model_path = cfg.model
        self.model_name = cfg.served_model_name or ""
        self.receipt: list[str] = []
        self._defaults: dict = {}  # sampling defaults from the model's generation config
        self._vocab_size = 0
        self.engine: AsyncEngine | None = None
        self.live_profile: LiveProfile | None = None  # a MoE model's, once loaded
        self.started = time.monotonic()
        self._engine_task: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self._hurry = asyncio.Event()
        self.compiles: CompileLog | None = None  # on CUDA: every kernel variant built, by phase
        self.kernel_cache: Path | None = None
        self.step_thread = step_executor()  # where the warm-up and then every served step run
        self.ranks: RankWorkers | None = None  # under --tp N: ranks 1..N-1 (engine/tp_processes.py)
        self._fatal: str | None = None  # why a rank or the HTTP front ended, stopping the daemon with status 1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._address: tuple[str, int] | str = ""  # where the HTTP socket listens (set once bound)

    # -- life ---------------------------------------------------------------------------

    async def run(self) -> int:
        loop = self._loop = asyncio.get_running_loop()
        # Python-level handlers, which the loop runs when a signal wakes it (uvloop runs CPython's pending
        # handlers), not `loop.add_signal_handler`: removing a loop's handler puts back the default action
        # for a moment before SIG_IGN can follow, and a SIGTERM landing there ended the process with -15
        # (tests/server/test_daemon.py, under load); ours are swapped for SIG_IGN in one call at the end.
        signal.signal(signal.SIGTERM, lambda *_: loop.call_soon_threadsafe(self.request_stop, "SIGTERM"))
        signal.signal(signal.SIGINT, lambda *_: loop.call_soon_threadsafe(self.request_stop, "SIGINT", True))
        try:
            self.api_key = load_api_key(self.cfg, os.environ)
        except ApiKeyError as e:
            log.error("cannot start: %s", e)
            return 1
        try:
            sock = listen(self.cfg)
        except OSError as e:
            log.error("cannot serve HTTP: %s", e)
            return 1
        self._address = address_of(sock)
        try:
            self.front = await Front.spawn(self.cfg, self.api_key, sock, self.metrics, self.process_ended)
        except OSError as e:
            log.error("cannot start the HTTP front process: %s", e)
            return 1
        watchdog = asyncio.create_task(self._watchdog())
        control_server = None
        control_path = self.cfg.control_socket or control.default_socket_path()
        gc_pauses = self.metrics.watch_gc()
        try:
            control_server = await control.serve(control_path, ControlHandlers(self).table())
            code = await self._serve()
        except control.ControlSocketError as e:
            log.error("%s", e)
            code = 1
        finally:
            await self.front.set_phase(Phase.DRAINING)
            await self.front.stop()
            if control_server is not None:
                control_server.close()
                _unlink(control_path)
            if self.cfg.http_socket:
                _unlink(self.cfg.http_socket)
            watchdog.cancel()
            if self._engine_task is not None:
                self._engine_task.cancel()
                await asyncio.gather(self._engine_task, return_exceptions=True)
            if self.ranks is not None:  # rank 0's engine closes (their step loops end), then they are awaited
                self.ranks.stop(self.engine.engine if self.engine is not None and self._fatal is None else None)
            gc_pauses.close()
        for sig in (signal.SIGTERM, signal.SIGINT):  # a late SIGTERM must not turn this status into -15
            signal.signal(sig, signal.SIG_IGN)
        log.info("exiting with status %d", code)
        return code

    async def _serve(self) -> int:
        try:
            engine = await self._load()
        except _StartFailed:
            return 1
        if engine is None:
            return 1 if self._fatal else 0  # stopped while loading: nothing to drain
        self.engine = engine
        self._engine_task = asyncio.create_task(engine.run())
        self.front.serve_model(engine, self.model_name, engine.engine.receipt.max_model_len,
                               self._defaults, self._vocab_size)  # still LOADING: only warm-up is admitted
        try:
            await warm_up_served(engine, self._vocab_size, then=self._warm_up_rest)
        except Exception:
            log.exception("cannot start: the first requests through the served path failed")
            return 1
        if self.compiles is not None:
            self.compiles.phase = "serving"  # from here a kernel build is a user's wait: counted, warned
        gc.collect()
        gc.freeze()  # the start-up heap, never scanned again: a full collection of it took 74 ms (tiny model, CPU)
        await self.front.set_phase(Phase.READY)
        notify.ready(f"serving {self.model_name}")
        log.info("ready: serving %s", self.model_name)
        stop = asyncio.create_task(self._stop.wait())
        await asyncio.wait((stop, self._engine_task), return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not self._engine_task.done():
            await self._drain()
        if self._engine_task.done():  # it failed (while serving or while draining)
            error = self._engine_task.exception()
            log.critical("the engine failed; exiting so the service manager restarts it",
                         exc_info=(type(error), error, error.__traceback__) if error else None)
            return 1
        return 1 if self._fatal else 0

    async def _warm_up_rest(self) -> None:
        """warm_up_served's last part: the HTTP path, then with --speculative the cost model measured
        on this machine (engine/drafting_cost.py: on the step thread, now that the loader thread ended)."""
        await self._warm_up_http()
        if self.engine.scheduler.drafting is not None:
            said = await self.engine.between_steps(lambda: drafting_cost.adopt(self.engine.engine, self._vocab_size))
            log.info("%s", said or "speculative decoding's cost model: nothing measured, r stays the device type's")

    async def _warm_up_http(self) -> None:
        """The HTTP path's first uses, before ready: requests to the daemon's own socket (server/self_warmup.py)."""
        start = time.perf_counter()
        token = secrets.token_hex(16)
        await self.front.set_phase(Phase.LOADING, token)
        try:
            sent = await warm_up_http(self._address, token, self.model_name,
                                      chat=self.engine.tokenizer.chat_template is not None, api_key=self.api_key)
        finally:
            await self.front.set_phase(Phase.LOADING)
        log.info("warm-up: %d requests through the HTTP socket in %.0f ms", sent, (time.perf_counter() - start) * 1e3)

    async def _load(self) -> AsyncEngine | None:
        """Build the engine on a thread (torch stays off the loop); None when a stop
        came first (the thread is a daemon thread: exiting does not wait for it).
        Raises _StartFailed, logged, when loading fails."""
        try:
            trace = StepTrace.from_env()
        except OSError as e:
            log.error("cannot start: %s=%s cannot be opened for appending (%s); unset it, or name a file the "
                      "daemon may write", step_trace.ENV, os.environ.get(step_trace.ENV), e.strerror or e)
            raise _StartFailed from None
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()  # a load error is reported below
        threading.Thread(target=call_into, args=(loop, done, self._build), name="radianced-load", daemon=True).start()
        stop = asyncio.create_task(self._stop.wait())
        while not done.done() and not stop.done():
            notify.extend_timeout(int(EXTEND_S * 1e6))
            await asyncio.wait((done, stop), timeout=EXTEND_EVERY_S, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not done.done():
            log.info("stopped while loading")
            return None
        try:
            engine = done.result()
        except _LOAD_ERRORS as e:
            log.error("cannot start: %s", e)
            raise _StartFailed from None
        except Exception:
            log.exception("cannot start: loading the model failed")
            raise _StartFailed from None
        graphs = engine.runner.graphs
        graph_tokens = max(graphs.mixed, default=0) if graphs is not None else 0
        return AsyncEngine(engine, self.metrics, StepPacer.for_config(self.cfg, graph_tokens), self.step_thread,
                           trace)

    def _build(self):
        """Open the model, plan the card, allocate and load (on the loader thread)."""
        import torch

        from radianced.engine.engine import Engine
        from radianced.model.default import ensure_default_model

        path = Path(self.model_path) if self.model_path else ensure_default_model()
        self.model_path = str(path)
        self.model_name = self.cfg.served_model_name or path.stem
        log.info("loading %s", path)
        rad = RadFile.open(path)
        self._defaults = generation_defaults(rad.header.generation or {})
        self._vocab_size = rad.model.vocab_size
        self.live_profile = LiveProfile.for_model(rad) if rad.header.experts else None
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":  # before the first kernel: where binaries persist, and every build counted
            self.kernel_cache = use_kernel_cache()
            self.compiles = CompileLog.install()
            self.compiles.listeners.append(lambda b: self.metrics.add_kernel_build(b.phase, b.kind))
            self.metrics.watch_cuda_allocator(torch.device("cuda", torch.cuda.current_device()))
        if device == "cpu" or "RADIANCED_CPU_THREADS" in os.environ:
            torch.set_num_threads(cpu_threads.count())
            log.info("torch CPU threads: %d", torch.get_num_threads())
        if UNBOUND:
            log.warning("ignored %s: OpenMP would hold every thread of the daemon and its HTTP front to one CPU "
                        "(radianced/cpu_threads.py); RADIANCED_CPU_THREADS sets the threads",
                        ", ".join(f"{k}={v}" for k, v in UNBOUND.items()))
        card = None
        if self.cfg.card_mib:  # the arena's allocation unit is the device's, whatever size is claimed
            card = Card.from_mib(self.cfg.card_mib, cuda=device == "cuda")
        start = time.monotonic()
        engine = Engine.build(rad, self.cfg, card, device, group=self._start_ranks(path, device))
        self.receipt = (engine.cards or engine.receipt).lines()
        if self.compiles is not None:
            self.receipt.append(f"kernel cache: {self.kernel_cache} (Triton binaries and autotune results; "
                                "a restart loads them instead of compiling)")
            log.info(self.receipt[-1])
        # before ready, on the thread that will serve (engine/warmup.py)
        log.info(warm_up_start(engine, self.cfg, device, rad.model.vocab_size, self.step_thread, self.compiles))
        # the prompt byte check's bound, computed here, off the loop (it reads the whole vocabulary)
        longest, context = engine.tokenizer.max_token_bytes, engine.receipt.max_model_len
        log.info("prompts over %d bytes are refused before tokenizing (--max-model-len %d, at most %d bytes a "
                 "token)", max_prompt_bytes(context, longest), context, longest)
        log.info("loaded %s on %s in %.1f s", self.model_name, device, time.monotonic() - start)
        return engine

    def _start_ranks(self, path: Path, device: str) -> Group:
        """Under --tp N, spawn ranks 1..N-1, watched, and join them as rank 0; SINGLE otherwise."""
        if self.cfg.tp == 1:
            return SINGLE
        refuse_device(self.cfg, device)
        self.ranks = RankWorkers.start(str(path), self.cfg, lambda line: self._loop.call_soon_threadsafe(
            self.process_ended, line))
        return self.ranks.join()

    def process_ended(self, line: str) -> None:
        """A rank of --tp, or the HTTP front, ended unasked: say which and why, and stop with status 1
        (nothing to drain into)."""
        log.error("%s; stopping", line)
        self._fatal = line
        self.request_stop("a process ended")
        self._hurry.set()

    def request_stop(self, why: str = "stop", again_hurries: bool = False) -> None:
        """Begin the drain. Once begun, a call with `again_hurries` (a second Ctrl-C) cuts it
        short; others are ignored: a shell's process-group kill and `make` forwarding it
        deliver SIGTERM twice at once."""
        if not self._stop.is_set():
            log.info("%s: draining", why)
            self._stop.set()
        elif again_hurries:
            log.warning("%s again: cancelling what is still running", why)
            self._hurry.set()
        else:
            log.info("%s: already draining", why)

    async def _drain(self) -> None:
        await self.front.set_phase(Phase.DRAINING)
        timeout = self.cfg.drain_timeout
        notify.stopping(f"draining {self.engine.num_live} requests")
        notify.extend_timeout(int((timeout + STOP_EXTRA_S) * 1e6))
        log.info("draining %d requests (%d HTTP requests in flight) for up to %g s",
                 self.engine.num_live, self.front.in_flight, timeout)
        idle = asyncio.create_task(self.front.wait_idle())
        hurry = asyncio.create_task(self._hurry.wait())
        await asyncio.wait((idle, hurry), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        hurry.cancel()
        if not idle.done():
            n = self.engine.cancel_all()
            log.warning("drain ended with %d requests still running: cancelled", n)
            try:
                await asyncio.wait_for(idle, SHUTDOWN_GRACE_S)
            except asyncio.TimeoutError:
                log.warning("HTTP requests still open after the drain (%d at its start)", self.front.in_flight)
        log.info("drained")

    async def _watchdog(self) -> None:
        """WATCHDOG=1 at half the interval while loading, or while the engine task lives
        and has either finished a step since the last ping or has nothing to do."""
        interval = notify.watchdog_interval()
        if interval is None:
            return
        last = -1
        while True:
            engine, task = self.engine, self._engine_task
            if engine is None and task is None:
                notify.watchdog()  # loading (a hung load is TimeoutStartSec's to catch)
            elif task is not None and not task.done() and (engine.idle or engine.steps != last):
                notify.watchdog()
            last = engine.steps if engine is not None else -1
            await asyncio.sleep(interval / 2)


class _StartFailed(Exception):
    """Start-up failed; the reason is logged."""


def use_kernel_cache() -> Path:
    """Where Triton keeps its binaries and autotune results (fla-core's included), made to persist:
    $TRITON_CACHE_DIR if set, else `kernels` in radianced's cache folder (model/default.cache_dir)."""
    from radianced.model.default import cache_dir

    path = Path(os.environ.get("TRITON_CACHE_DIR") or cache_dir() / "kernels")
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(path)
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # Triton's own autotune results on disk too
    return path


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
