"""The daemon's log records written by a thread of their own."""

from __future__ import annotations

import contextlib
import logging
import queue
from logging.handlers import QueueHandler, QueueListener

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@contextlib.contextmanager
def logs_off_the_loop(stream):
    """While inside, every logger's records (INFO and up) go through a queue to one thread that writes them to
    `stream`; on leaving, the records still queued are written first. A write can block (a full pipe; stderr
    redirected to a file while the page cache writes back a model just made, a possible cause of the one
    100 ms stall the H200 showed between a request's arrival and the engine, at 7d62b54): it then stalls that
    thread, not the event loop or the step thread, which only format and enqueue."""
    records: queue.SimpleQueue = queue.SimpleQueue()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(FORMAT))
    enqueue, root = QueueHandler(records), logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(enqueue)
    writer = QueueListener(records, handler)
    writer.start()
    try:
        yield
    finally:
        writer.stop()
        root.removeHandler(enqueue)
