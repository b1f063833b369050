"""server/log_writer.py: a log write that blocks stalls the writer thread, not the thread that logged."""

from __future__ import annotations

import logging
import logging.handlers
import threading

import pytest

from radianced.server.log_writer import logs_off_the_loop


class StuckStream:
    """A stream whose writes wait until `go` is set (a full pipe, a file under writeback throttling)."""

    def __init__(self):
        self.go, self.text, self.writer = threading.Event(), [], None

    def write(self, s: str) -> None:
        self.writer = threading.current_thread()
        self.go.wait()
        self.text.append(s)

    def flush(self) -> None:
        pass


@pytest.fixture(autouse=True)
def root_level():
    """The root logger's level and handlers as they were (logs_off_the_loop sets INFO and keeps a handler)."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    root.setLevel(level)
    root.handlers[:] = handlers


def test_logging_returns_while_the_write_is_stuck_and_every_record_lands_in_order():
    stream, log = StuckStream(), logging.getLogger("radianced.test_log_writer")
    with logs_off_the_loop(stream):
        logging_thread = threading.Thread(target=lambda: [log.info("record %d", i) for i in range(50)])
        logging_thread.start()
        logging_thread.join(timeout=30)  # with the write in the logging thread this would wait for `go` forever
        returned = not logging_thread.is_alive()
        assert not stream.text  # the first write is still stuck
        stream.go.set()
    assert returned
    lines = "".join(stream.text).splitlines()
    assert [line.split(": ", 1)[1] for line in lines] == [f"record {i}" for i in range(50)]
    assert " INFO radianced.test_log_writer: record 0" in lines[0]
    assert stream.writer is not threading.current_thread()
    assert not any(isinstance(h, logging.handlers.QueueHandler) for h in logging.getLogger().handlers)


class ListStream:
    def __init__(self):
        self.text, self.threads = [], []

    def write(self, s: str) -> None:
        self.text.append(s)
        self.threads.append(threading.current_thread())

    def flush(self) -> None:
        pass


def test_warnings_are_written_at_once_by_the_thread_that_logs_and_records_after_the_end_still_land():
    stream, log = ListStream(), logging.getLogger("radianced.test_log_writer")
    with logs_off_the_loop(stream):
        log.error("the card fell off the bus")
        assert stream.text and "ERROR radianced.test_log_writer: the card fell off the bus" in stream.text[0]
        assert stream.threads == [threading.current_thread()]  # not queued: a crash right after keeps it
        log.info("queued")
    log.info("after the end")
    lines = "".join(stream.text).splitlines()
    assert [line.split(": ", 1)[1] for line in lines] == ["the card fell off the bus", "queued", "after the end"]
