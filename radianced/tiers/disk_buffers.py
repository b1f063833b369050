"""The disk tier's layer buffers: where a step's routed disk-homed experts are read for that step.

Disk tier (`--weights-disk-tier`): experts whose home is the model file have
no host row. When a step's router sends tokens to one without a slot, the
slab's `prepare` has it read (ExpertLoader: io_uring, O_DIRECT, checksum) into
the layer's buffer (two halves of the arena's reserved pages, alternating by
routed layer) and points the table there until the step ends. A failed read
points the expert at a zeroed row, so only the tokens routed to it compute
garbage; the step's `StepRecord.failures()` names their rows and the error,
and the runner fails exactly the requests those rows belong to.
"""

from __future__ import annotations

import torch

from radianced.tiers.expert_loader import ExpertLoader
from radianced.tiers.placement import Key
from radianced.tiers.routing import SlabStats


class DiskBuffers:
    """The two buffers, and what the current step read into them (its staged experts and failures)."""

    def __init__(self, reserved: range, slab: torch.Tensor, loader: ExpertLoader | None, stats: SlabStats):
        """reserved: the arena's reserved pages (rows of `slab`); reads are counted in `stats`."""
        half = len(reserved) // 2
        self._halves = (reserved[:half], reserved[half:2 * half])
        self.slab, self.loader, self.stats = slab, loader, stats
        self._staged: list[Key] = []  # disk experts pointed at a buffer row for this step
        self._failed_rows: torch.Tensor | None = None  # [T] bool: rows routed to an expert that failed to read
        self._errors: list[str] = []

    def begin_step(self) -> None:
        """Forget the failures of a step that never ended."""
        self._failed_rows, self._errors = None, []

    def stage(self, layer: int, pos: int, missing: list[int], expert_ids: torch.Tensor) -> list[tuple[Key, int]]:
        """Read the `missing` experts of `layer` (routed layer position `pos`; routed as
        `expert_ids` [T, k]) into its buffer; returns (key, row) for each: where the table points
        it until `end_step` (a zeroed row where the read failed)."""
        buffer = self._halves[pos % 2]
        if len(missing) > len(buffer):
            raise RuntimeError(f"layer {layer} routed {len(missing)} disk experts in one step; its buffer holds "
                               f"{len(buffer)} (the receipt sizes it for --max-num-batched-tokens)")
        keys = [(layer, e) for e in missing]
        results = self.loader.load(keys, buffer[:len(keys)])
        for key, row, r in zip(keys, buffer, results):
            self._staged.append(key)
            if r.ok:
                self.stats.disk_reads += 1
                self.stats.disk_bytes += r.nbytes
                continue
            self.slab[row].zero_()  # its tokens get no contribution from it; their requests fail
            rows = (expert_ids == key[1]).any(dim=-1)
            self._failed_rows = rows if self._failed_rows is None else self._failed_rows | rows
            self._errors.append(r.error)
        return list(zip(keys, buffer))

    def end_step(self) -> tuple[list[Key], torch.Tensor | None, list[str]]:
        """The step's staged experts (no longer addressable: their rows are reused), its rows
        routed to an expert that failed to read ([T] bool, or None) and the errors; forgets them."""
        out = self._staged, self._failed_rows, self._errors
        self._staged, self._failed_rows, self._errors = [], None, []
        return out
