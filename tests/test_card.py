"""The card the budget divides: its units and this machine's card."""

from __future__ import annotations

import pytest

from radianced.card import ALLOC_GRANULE, PAGE_ALIGN, Card, align_up, detect_card


def test_align_up_rounds_to_whole_units():
    assert (align_up(0), align_up(1), align_up(4096), align_up(4097)) == (0, 4096, 4096, 8192)
    assert align_up(3 << 20, ALLOC_GRANULE) == 4 << 20


def test_a_cuda_card_allocates_in_2_mib_units_and_the_cpu_in_4_kib_pages():
    assert Card.from_mib(1024, cuda=True).alloc_granule == ALLOC_GRANULE == 2 << 20
    assert Card.from_mib(1024).alloc_granule == PAGE_ALIGN == 4096


def test_from_mib_plans_an_empty_card_unless_told_what_is_free():
    assert Card.from_mib(8) == Card(8 << 20, 8 << 20)
    assert Card.from_mib(8, 6, cuda=True) == Card(8 << 20, 6 << 20, cuda=True)


def test_free_bytes_must_lie_between_zero_and_the_total():
    with pytest.raises(ValueError, match="card free bytes 9 must be between 0 and total 8"):
        Card(8, 9)
    with pytest.raises(ValueError, match="card free bytes -1 must be between 0 and total 8"):
        Card(8, -1)


def test_the_cpu_card_is_half_of_ram():
    import psutil

    card = detect_card("cpu")
    assert card.total_bytes == psutil.virtual_memory().total // 2 and 0 < card.free_bytes <= card.total_bytes
