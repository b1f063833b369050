"""The disk tier's layer buffers on their own (tiers/disk_buffers.py), with a scripted loader.

The arena's reserved pages 4-7 are the two buffers: rows 4-5 for even routed-layer positions,
6-7 for odd ones. A failed read leaves its row zeroed and names the rows routed to it.
"""

from __future__ import annotations

import pytest
import torch

from radianced.tiers.disk import ReadResult
from radianced.tiers.disk_buffers import DiskBuffers
from radianced.tiers.routing import SlabStats

WIDTH = 8


class Loader:
    """Writes expert e's rows as e + 1; `fail` names experts whose read fails."""

    def __init__(self, slab: torch.Tensor, fail=()):
        self.slab, self.fail, self.calls = slab, set(fail), []

    def load(self, keys, rows):
        self.calls.append((list(keys), list(rows)))
        out = []
        for key, row in zip(keys, rows):
            if key in self.fail:
                out.append(ReadResult(key, 0, 32, f"expert {key}: read failed"))
            else:
                self.slab[row] = key[1] + 1
                out.append(ReadResult(key, 0, 32))
        return out


def buffers(fail=()) -> tuple[DiskBuffers, Loader]:
    slab = torch.full((8, WIDTH), -1.0)
    loader = Loader(slab, fail)
    return DiskBuffers(range(4, 8), slab, loader, SlabStats((3, 5, 7))), loader


def test_routed_layers_alternate_between_the_two_buffers():
    disk, loader = buffers()
    ids = torch.tensor([[1, 2]])
    assert disk.stage(3, 0, [1, 2], ids) == [((3, 1), 4), ((3, 2), 5)]
    assert disk.stage(5, 1, [2], ids) == [((5, 2), 6)]
    assert disk.stage(7, 2, [0], ids) == [((7, 0), 4)]  # position 2: the first buffer again
    assert [rows for _, rows in loader.calls] == [[4, 5], [6], [4]]
    assert (disk.stats.disk_reads, disk.stats.disk_bytes) == (4, 4 * 32)
    assert disk.end_step() == ([(3, 1), (3, 2), (5, 2), (7, 0)], None, [])
    assert disk.end_step() == ([], None, [])


def test_a_failed_read_zeroes_its_row_and_names_the_rows_routed_to_it():
    disk, _ = buffers(fail={(3, 2)})
    ids = torch.tensor([[1, 2], [0, 1], [2, 3]])  # rows 0 and 2 routed to expert 2
    assert disk.stage(3, 0, [1, 2], ids) == [((3, 1), 4), ((3, 2), 5)]
    assert (disk.slab[4] == 2).all() and (disk.slab[5] == 0).all()
    assert (disk.stats.disk_reads, disk.stats.disk_bytes) == (1, 32)
    staged, failed_rows, errors = disk.end_step()
    assert staged == [(3, 1), (3, 2)] and failed_rows.tolist() == [True, False, True]
    assert errors == ["expert (3, 2): read failed"]


def test_a_new_step_forgets_the_failures_of_one_that_never_ended():
    disk, _ = buffers(fail={(3, 1)})
    disk.stage(3, 0, [1], torch.tensor([[1, 0]]))
    disk.begin_step()
    staged, failed_rows, errors = disk.end_step()
    assert staged == [(3, 1)] and failed_rows is None and errors == []  # still pointed at a row: unpoint it


def test_a_layer_routing_more_disk_experts_than_its_buffer_holds_is_refused():
    disk, loader = buffers()
    with pytest.raises(RuntimeError, match="layer 3 routed 3 disk experts in one step; its buffer holds 2"):
        disk.stage(3, 0, [0, 1, 2], torch.tensor([[0, 1], [2, 0]]))
    assert loader.calls == []
