"""The disk reader's test hook: make chosen experts' reads fail or arrive late.

`DiskReader` (disk.py) consults its `faults` as it issues and completes reads.
`HostPool.create` hands one to the reader that fills the pool, and tests arm
one on a running engine's reader (`engine.experts.loader.reader.faults`), so
that one expert's read fails, or arrives late, in a known step.
"""

from __future__ import annotations

import errno as errnos
from dataclasses import dataclass, field

Key = tuple[int, int]  # (layer, expert)


@dataclass
class Faults:
    """Test hook: make chosen experts' reads fail or wait. Each entry fires once.

    `fail`: the read is issued as usual, and its completion is replaced by
    -errno, as from a failing device. `delay`: the read is queued behind a
    kernel timeout (a linked IORING_OP_TIMEOUT), so it is a real read that
    completes late and the reader really waits for it.
    """

    failures: dict[Key, int] = field(default_factory=dict)
    delays: dict[Key, float] = field(default_factory=dict)

    def fail(self, layer: int, expert: int, err: int = errnos.EIO) -> None:
        self.failures[(layer, expert)] = err

    def delay(self, layer: int, expert: int, seconds: float) -> None:
        self.delays[(layer, expert)] = seconds
