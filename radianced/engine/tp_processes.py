"""The processes of `--tp N`: the daemon is rank 0, and starts ranks 1..N-1 before its engine.

Each worker is a spawned process (a fork would copy the daemon's threads and torch state) that
joins the gloo group at 127.0.0.1 on a free port, builds its card (`WorkerShard.for_card`) and
serves rank 0's steps until rank 0's engine closes. A worker that fails says why on its pipe and
exits 1; `RankWorkers.watch` calls back once for the first rank that ends while the daemon did
not ask it to (its error, or its exit code), so the daemon stops with that line. Rank 0's own
collectives with a dead rank fail as its sockets close, so no step waits for it.

The group's timeout (`JOIN_TIMEOUT_S`) bounds the join and any one collective; a worker waits
for the next step inside one, so it is long: a dead peer is noticed by its closed socket, not by
the timeout.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import traceback
from collections.abc import Callable
from multiprocessing import connection

import torch
import torch.multiprocessing as mp

from radianced.config import Config
from radianced.engine.tp_workers import WorkerShard
from radianced.model.parallel import NCCL_ENV, ProcessGroup
from radianced.model.rad import RadFile

log = logging.getLogger("radianced")
JOIN_TIMEOUT_S = 24 * 3600  # a worker idles inside a broadcast until the next step comes
STOP_WAIT_S = 10.0  # how long `stop` waits for a worker to leave before it is killed


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank: int, size: int, address: str) -> ProcessGroup:
    """This process's rank of the CPU group at `address`."""
    return ProcessGroup.join(rank, size, address, torch.device("cpu"),
                             timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))


def _worker(rank: int, size: int, address: str, model: str, cfg: Config, threads: int, report) -> None:
    """Rank `rank`'s life: join, build its card, serve steps; any failure said on `report`."""
    os.environ.update(NCCL_ENV)
    torch.set_num_threads(threads)
    try:
        group = join(rank, size, address)
        # built outside inference mode, as rank 0's engine is: the slab patches its tables between steps
        shard = WorkerShard.for_card(RadFile.open(model), cfg, group)
        shard.serve_steps()
        group.close()
    except BaseException as e:  # reported to rank 0, which names the rank in its stop line
        report.send(f"{type(e).__name__}: {e}")
        traceback.print_exc()
        raise SystemExit(1) from None


class RankWorkers:
    """Ranks 1..N-1 of `--tp N`, started by rank 0 (`start`), watched (`watch`) and stopped (`stop`)."""

    def __init__(self, processes: list, reports: list, address: str):
        self.processes, self.reports, self.address = processes, reports, address
        self.stopping = False

    @classmethod
    def start(cls, model: str, cfg: Config, died: Callable[[str], None]) -> RankWorkers:
        """Spawn the workers of `cfg.tp` ranks (torch's threads each: this process's count), `watch`ed
        with `died`; rank 0 then `join`s."""
        ctx, threads = mp.get_context("spawn"), torch.get_num_threads()
        address = f"127.0.0.1:{free_port()}"
        processes, reports = [], []
        os.environ.update(NCCL_ENV)  # the spawned processes inherit it
        for rank in range(1, cfg.tp):
            ours, theirs = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, args=(rank, cfg.tp, address, model, cfg, threads, theirs),
                            name=f"radianced-rank{rank}", daemon=True)
            p.start()
            theirs.close()
            processes.append(p)
            reports.append(ours)
        workers = cls(processes, reports, address)
        workers.watch(died)
        return workers

    def join(self) -> ProcessGroup:
        """Rank 0's place in the group (waits for every worker to join)."""
        return join(0, len(self.processes) + 1, self.address)

    def watch(self, died: Callable[[str], None]) -> None:
        """Call `died(line)` (on a watcher thread) for the first worker that ends unasked."""
        def run() -> None:
            sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, 1)}
            ready = connection.wait(list(sentinels))
            if self.stopping:
                return
            rank = sentinels[ready[0]]
            p, report = self.processes[rank - 1], self.reports[rank - 1]
            p.join()
            try:  # its last word, if it said one (a closed pipe polls ready too)
                why = report.recv() if report.poll() else f"exit code {p.exitcode}"
            except EOFError:
                why = f"exit code {p.exitcode}"
            died(f"rank {rank} of --tp {len(self.processes) + 1} ended: {why}")

        threading.Thread(target=run, name="radianced-rank-watch", daemon=True).start()

    def stop(self, engine=None) -> None:
        """Close rank 0's `engine` if given (the workers' step loops end), then wait for the workers and
        kill the stragglers (none is given after a rank died: its collective would fail)."""
        self.stopping = True
        if engine is not None:
            sent = engine.runner.workers
            log.info("step broadcast to the other ranks: %d steps, %.3f ms a step", sent.steps,
                     1e3 * sent.seconds / max(sent.steps, 1))
            engine.close()
        for p in self.processes:
            p.join(STOP_WAIT_S)
            if p.is_alive():
                p.kill()
                p.join()
