"""A call made on another thread for a coroutine on the event loop to await (the daemon's model load,
the driver's `between_steps`): `call_into(loop, future, fn)` runs fn() on the calling thread and settles
`future` on `loop` with its result, or with the exception it raised."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def call_into(loop: asyncio.AbstractEventLoop, future: asyncio.Future, fn: Callable[[], object]) -> None:
    try:
        result, error = fn(), None
    except BaseException as e:  # handed to the coroutine awaiting `future`
        result, error = None, e
    loop.call_soon_threadsafe(_settle, future, result, error)


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if not future.done():  # not cancelled meanwhile
        future.set_result(result) if error is None else future.set_exception(error)
