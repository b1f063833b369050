"""server/front_frames.py: every frame survives msgpack as sent, and a byte stream cut anywhere (or
several frames in one read) gives the frames whole, in order, each once."""

from __future__ import annotations

import msgspec

from radianced.config import Config
from radianced.engine.sampling_params import SamplingParams
from radianced.engine.streams import Chunk
from radianced.server import front_frames as f

FRAMES = [
    f.Start(Config(port=0, max_num_seqs=3), "key"),
    f.Submit("a1", list(range(2000)), SamplingParams(max_tokens=5, stop=("\n\n", "END"), seed=7), 12.5, 0.001, 0.02),
    f.Accepted("a1"),
    f.Chunks("a1", [Chunk((5, 6), "hé", None, [-0.25, [[5, -0.25], [9, -1.5]]]), Chunk((7,), "!", "stop", None, 3)]),
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

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return False


def wire() -> bytes:
    conn = f.FrameConnection(lambda frame: None, lambda: None)
    conn.connection_made(Transport())
    for frame in FRAMES:
        conn.send(frame)
    return bytes(conn._transport.written)


def test_each_frame_is_taken_as_it_was_sent():
    decoder = msgspec.msgpack.Decoder(f.Frame)
    for frame in FRAMES:
        assert decoder.decode(msgspec.msgpack.encode(frame)) == frame
    taken = []
    conn = f.FrameConnection(taken.append, lambda: None)
    conn.data_received(wire())
    assert [type(x) for x in taken] == [type(x) for x in FRAMES]
    assert taken[1].params == FRAMES[1].params and taken[1].prompt_ids == list(range(2000))
    chunks = taken[3].chunks
    assert chunks[0].logprobs == [-0.25, [[5, -0.25], [9, -1.5]]] and chunks[1].reused_tokens == 3


def test_a_stream_cut_at_any_byte_gives_the_frames_whole_and_in_order():
    data = wire()
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
