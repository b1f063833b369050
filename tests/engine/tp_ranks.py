"""Two gloo ranks on this machine for the --tp tests: rank 0 in the test process, rank 1 a spawned
process that serves the jobs rank 0 broadcasts until it broadcasts None."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from radianced.engine.tp_processes import free_port
from radianced.model.parallel import ProcessGroup


def jobs(rank: int, port: int) -> Iterator[tuple[ProcessGroup, object]]:
    """A worker rank's side: join the group (one torch thread), then (group, job) for each job rank 0
    broadcasts, until it broadcasts None; then leave the group."""
    torch.set_num_threads(1)
    group = ProcessGroup.join(rank, 2, f"127.0.0.1:{port}", torch.device("cpu"))
    while True:
        job = [None]
        dist.broadcast_object_list(job, src=0)
        if job[0] is None:
            break
        yield group, job[0]
    group.close()


@contextlib.contextmanager
def two_ranks(worker: Callable[[int, int], None]) -> Iterator[ProcessGroup]:
    """Rank 0's group, with `worker(1, port)` running as rank 1 in a spawned process; on exit rank 1 is
    told to stop (None) and awaited."""
    port = free_port()
    process = mp.get_context("spawn").Process(target=worker, args=(1, port), daemon=True)
    process.start()
    group = ProcessGroup.join(0, 2, f"127.0.0.1:{port}", torch.device("cpu"))
    try:
        yield group
    finally:
        dist.broadcast_object_list([None], src=0)
        process.join(timeout=30)
        group.close()
