"""What the daemon and its HTTP front process say to each other, and the connection that carries it.

The daemon's process runs the engine (the step thread, the control socket, the metrics); the front
process runs uvicorn, the routes, the tokenizer and the SSE writers (server/front.py). They share one
AF_UNIX stream socket, made as a pair before the front is spawned. A frame is a 4-byte little-endian
length, then one of the structs below as msgpack (msgspec, tagged by class name). Frames are taken in
the order they were sent, each by a plain call on the taker's event loop (`FrameConnection`): no task,
no await, per frame; what one turn of a loop sends goes in one write.

The front to the daemon: `Submit` (answered `Accepted` or `Refused`, then the request's `Output`s, or
`Failed`), `Cancel`, `RequestDone` (the HTTP status, for the request counter), `InFlight` (whether
HTTP requests are being answered, when that changes: the drain waits for none), `AskMetrics`
(answered `MetricsText`), `Ping` (/health asks whether the daemon's loop answers: `Ack`) and `Ack`.
The daemon to the front: `Start` (the flags), `ServedModel` (once loaded: what the routes and the
tokenizer need), `PhaseSet` (loading, ready, draining, and the warm-up token; answered `Ack` with the
requests in flight, so a client told "ready" finds the front ready) and `Exit`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any, Union

import msgspec

from radianced.config import Config
from radianced.engine.sampling_params import SamplingParams
from radianced.engine.streams import Chunk

_LENGTH = 4

log = logging.getLogger("radianced")


class _Frame(msgspec.Struct, tag=True, array_like=True):
    pass


# -- the front to the daemon -------------------------------------------------------------


class Submit(_Frame):
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrived: float  # time.perf_counter() at the request's arrival (CLOCK_MONOTONIC: one clock for both)
    read_s: float  # its body's read
    prepare_s: float  # decoding, the chat template, tokenizing


class Cancel(_Frame):
    rid: str


class RequestDone(_Frame):
    status: int  # 499: the client left


class InFlight(_Frame):
    busy: bool  # some HTTP request is between its arrival and its last byte


class AskMetrics(_Frame):
    ask: int


class Ping(_Frame):
    ask: int


class Ack(_Frame):
    ask: int
    in_flight: int = 0  # the HTTP requests being answered (an Ack of PhaseSet)


# -- the daemon to the front -------------------------------------------------------------


class Start(_Frame):
    config: Config
    api_key: str | None  # --api-key, or the key file's


class ServedModel(_Frame):
    name: str
    max_model_len: int
    defaults: dict[str, Any]  # generation_defaults(header.generation)
    vocab_size: int
    tokenizer_json: str
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: list[int]


class PhaseSet(_Frame):
    phase: str  # state.Phase's value
    warm_up_token: str | None
    ask: int


class Accepted(_Frame):
    rid: str


class Refused(_Frame):
    rid: str
    status: int  # 429: the queue is full; 500: the engine failed
    message: str


class Output(_Frame):
    rid: str
    chunk: Chunk  # one dispatch's of the request: what a step gave it (a turn's frames go in one write)


class Failed(_Frame):
    rid: str
    message: str
    engine: bool  # True: the engine failed (every request); False: this request could not be computed


class MetricsText(_Frame):
    ask: int
    body: bytes
    content_type: str


class Exit(_Frame):
    pass


Frame = Union[Submit, Cancel, RequestDone, InFlight, AskMetrics, Ping, Ack, Start, ServedModel, PhaseSet, Accepted,
              Refused, Output, Failed, MetricsText, Exit]


class FrameConnection(asyncio.Protocol):
    """One end of the pair. `send(frame)` encodes a frame at once (an encoding error is the caller's) and
    writes it with every other frame sent in the same turn of the loop, in one write. Each frame that
    arrives is given to `on_frame` on the loop, in order; an exception there is logged and the next frame
    taken (a bug in one frame's handling is that request's, not the pair's). Bytes that do not decode
    close the pair (the two ends run different code), and `on_closed()` follows, once, as when the other
    end has gone (its process ended)."""

    def __init__(self, on_frame: Callable[[Frame], None], on_closed: Callable[[], None]):
        self.on_frame, self.on_closed = on_frame, on_closed
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Frame)
        self._buffer = bytearray()
        self._out = bytearray()  # frames sent this turn, written at its end
        self._transport: asyncio.Transport | None = None

    async def open(self, sock: socket.socket) -> None:
        """Speak over `sock` (one end of a socketpair), on the running loop."""
        await asyncio.get_running_loop().create_unix_connection(lambda: self, sock=sock)

    def send(self, frame: Frame) -> None:
        """Encode `frame` and write it at the end of this turn of the loop (dropped once the other end
        has gone: `on_closed` says so)."""
        if self._transport is None or self._transport.is_closing():
            return
        body = self._encoder.encode(frame)
        if not self._out:
            asyncio.get_running_loop().call_soon(self._write)
        self._out += len(body).to_bytes(_LENGTH, "little")
        self._out += body

    def _write(self) -> None:
        if self._out and self._transport is not None and not self._transport.is_closing():
            self._transport.write(bytes(self._out))
        self._out.clear()

    def close(self) -> None:
        """Write what was sent, then close."""
        if self._transport is not None:
            self._write()
            self._transport.close()

    def connection_made(self, transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        frames, start = [], 0
        try:
            while len(buffer) - start >= _LENGTH:
                n = int.from_bytes(buffer[start:start + _LENGTH], "little")
                if len(buffer) - start - _LENGTH < n:
                    break
                with memoryview(buffer) as view:
                    frames.append(self._decoder.decode(view[start + _LENGTH:start + _LENGTH + n]))
                start += _LENGTH + n
        except msgspec.DecodeError as e:
            log.error("a frame from the other process of the pair (the daemon and its HTTP front) does not decode "
                      "(%s): both must run the same radianced; closing", e)
            self.close()
        del buffer[:start]
        for frame in frames:
            try:
                self.on_frame(frame)
            except Exception:
                log.exception("taking a %s frame failed", type(frame).__name__)

    def connection_lost(self, exc) -> None:
        self._transport = None
        self._out.clear()
        self.on_closed()
