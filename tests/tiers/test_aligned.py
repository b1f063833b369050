"""Aligned host memory for O_DIRECT (tiers/aligned.py): sizes, addresses, and each rule a destination can break."""

from __future__ import annotations

import numpy as np
import pytest

from radianced.tiers.aligned import ALIGN, align_up, aligned_buffer, buffer_address, check_buffer


def test_sizes_round_up_to_whole_blocks():
    assert [align_up(n) for n in (0, 1, 4096, 4097, 9216)] == [0, 4096, 4096, 8192, 12288]
    buf = aligned_buffer(9216)
    assert len(buf) == 12288 and not buf.readonly and bytes(buf) == bytes(12288)
    assert len(aligned_buffer(0)) == ALIGN  # never empty: one block
    assert buffer_address(buf) % ALIGN == 0


def test_a_destination_is_checked_rule_by_rule():
    buf = aligned_buffer(2 * ALIGN)
    flat = check_buffer(np.frombuffer(buf, dtype=np.int64), ALIGN, "dst")  # any format: viewed as bytes
    assert flat.format == "B" and flat.nbytes == 2 * ALIGN
    with pytest.raises(ValueError, match="^dst is read-only$"):
        check_buffer(bytes(ALIGN), ALIGN, "dst")
    with pytest.raises(ValueError, match="^dst is not contiguous$"):
        check_buffer(memoryview(buf)[::2], 1, "dst")
    with pytest.raises(ValueError, match=r"^dst holds 4096 bytes; the read needs 8192 \(the extent rounded up to "
                                         r"4096\)$"):
        check_buffer(buf[:ALIGN], 2 * ALIGN, "dst")
    with pytest.raises(ValueError, match="^dst is not 4096-byte aligned"):
        check_buffer(buf[1:], 1, "dst")
