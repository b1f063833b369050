"""The daemon's log records written by a thread of their own."""

from __future__ import annotations

import contextlib
import logging
import queue
from logging.handlers import QueueHandler, QueueListener

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@contextlib.contextmanager
def logs_off_the_loop(stream):
    """While inside, INFO records go through a queue to one thread that writes them to `stream`: a write can
    block (a full pipe; stderr redirected to a file while the page cache writes back a model just made, a
    possible cause of the one 100 ms stall the H200 showed between a request's arrival and the engine, at
    7d62b54), and then it stalls that thread, not the event loop or the step thread, which only format and
    enqueue. WARNING and above are written at once by the thread that logs them (one handler, one lock, for
    both paths): they are rare, and the lines that explain a crash must not wait in a queue a SIGKILL or a
    segfault would lose (INFO lines still queued then are lost). On leaving, every record is written at once
    again, and what is still queued is written before this returns; a record another thread logs meanwhile is
    kept (it may be written twice, or before the queued ones, never lost)."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.setLevel(logging.WARNING)  # the records it gets from the root logger; the queue's all reach it
    records: queue.SimpleQueue = queue.SimpleQueue()
    enqueue = QueueHandler(records)
    enqueue.addFilter(lambda record: record.levelno < logging.WARNING)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    root.addHandler(enqueue)
    writer = QueueListener(records, handler)
    writer.start()
    try:
        yield
    finally:
        handler.setLevel(logging.NOTSET)  # from here every record is written at once
        root.removeHandler(enqueue)
        writer.stop()  # after the records still queued
