"""server/front_frames.py: every frame survives msgpack as sent, what one turn of the loop sends is one
write, and a byte stream cut anywhere (or several frames in one read) gives the frames whole, in order,
each once; a frame whose handling fails is logged and the next taken; bytes that do not decode close
the pair, saying so."""

from __future__ import annotations

import asyncio
import logging

import msgspec

from radianced.config import Config
from radianced.engine.sampling_params import SamplingParams
from radianced.engine.streams import Chunk
from radianced.server import front_frames as f

FRAMES = [
    f.Start(Config(port=0, max_num_seqs=3), "key"),
    f.Submit("a1", list(range(2000)), SamplingParams(max_tokens=5, stop=("\n\n", "END"), seed=7), 12.5, 0.001, 0.02),
    f.Accepted("a1"),
    f.Output("a1", Chunk((5, 6), "hé", None, [-0.25, [[5, -0.25], [9, -1.5]]])),
    f.Output("a1", Chunk((7,), "!", "stop", None, 3)),
    f.Refused("a2", 429, "the queue is full"),
    f.Failed("a1", "expert (layer 1, expert 2) read failed", engine=False),
    f.PhaseSet("ready", None, 4),
    f.Ack(4),
    f.MetricsText(1, b"# HELP x\nx 1\n", "text/plain; version=0.0.4"),
    f.Exit(),
]


class Transport:
    def __init__(self):
        self.written = bytearray()

    writes = 0

    def write(self, data: bytes) -> None:
        self.written += data
        self.writes += 1

    def is_closing(self) -> bool:
        return False


async def wire() -> tuple[bytes, Transport]:
    """FRAMES as sent in one turn of the loop, and the transport they were written to."""
    conn = f.FrameConnection(lambda frame: None, lambda: None)
    conn.connection_made(transport := Transport())
    for frame in FRAMES:
        conn.send(frame)
    assert transport.writes == 0  # at the turn's end, all at once
    await asyncio.sleep(0)
    assert transport.writes == 1
    return bytes(transport.written), transport


async def test_each_frame_is_taken_as_it_was_sent():
    decoder = msgspec.msgpack.Decoder(f.Frame)
    for frame in FRAMES:
        assert decoder.decode(msgspec.msgpack.encode(frame)) == frame
    taken = []
    conn = f.FrameConnection(taken.append, lambda: None)
    conn.data_received((await wire())[0])
    assert [type(x) for x in taken] == [type(x) for x in FRAMES]
    assert taken[1].params == FRAMES[1].params and taken[1].prompt_ids == list(range(2000))
    assert taken[3].chunk.logprobs == [-0.25, [[5, -0.25], [9, -1.5]]] and taken[4].chunk.reused_tokens == 3


async def test_a_stream_cut_at_any_byte_gives_the_frames_whole_and_in_order():
    data, _ = await wire()
    for size in (1, 3, 7, 64, 4096):
        taken = []
        conn = f.FrameConnection(taken.append, lambda: None)
        for start in range(0, len(data), size):
            conn.data_received(data[start:start + size])
        assert taken == [msgspec.msgpack.Decoder(f.Frame).decode(msgspec.msgpack.encode(x)) for x in FRAMES], size
        assert not conn._buffer


def test_once_the_other_end_has_gone_a_send_is_dropped_and_said_once():
    closed = []
    conn = f.FrameConnection(lambda frame: None, lambda: closed.append(True))
    conn.connection_made(Transport())
    conn.connection_lost(None)
    conn.send(f.Exit())  # no transport: nothing raised
    assert closed == [True]


async def test_a_frame_whose_handling_fails_is_logged_and_the_next_is_taken(caplog):
    data, _ = await wire()
    taken = []

    def take(frame):
        if isinstance(frame, f.Accepted):
            raise ValueError("a bug in one request's handling")
        taken.append(frame)

    conn = f.FrameConnection(take, lambda: None)
    conn.connection_made(Transport())
    conn.data_received(data)
    assert len(taken) == len(FRAMES) - 1 and isinstance(taken[-1], f.Exit)
    assert "taking a Accepted frame failed" in caplog.text and "a bug in one request's handling" in caplog.text


async def test_bytes_that_do_not_decode_close_the_pair_saying_why(caplog):
    closed = []
    conn = f.FrameConnection(lambda frame: None, lambda: closed.append(True))
    transport = Transport()
    transport.close = lambda: conn.connection_lost(None)
    conn.connection_made(transport)
    with caplog.at_level(logging.ERROR):
        conn.data_received((3).to_bytes(4, "little") + b"\xc1\xc1\xc1")  # 0xc1: never used in msgpack
    assert closed == [True] and "both must run the same radianced" in caplog.text
