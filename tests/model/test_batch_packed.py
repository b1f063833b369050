"""model.batch.packed: a step's index vectors as views of one tensor, each on a 16-byte boundary
(an offset off it would make a kernel variant of its own), and ForwardBatch.build's vectors laid
out that way for odd token counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radianced.model.batch import ALIGN_BYTES, ForwardBatch, packed

LENGTHS = (0, 1, 3, 5, 17)


def check_packed(views: list[torch.Tensor], vectors: list[list[int]], dtype: torch.dtype) -> None:
    """Each view holds its vector and starts 16-byte aligned, and all are disjoint views of one storage,
    in order. (torch gives an empty view a data_ptr of 0: its start is read from its storage offset.)"""
    assert len(views) == len(vectors)
    storage = views[0].untyped_storage()
    base, end = storage.data_ptr(), 0
    for view, want in zip(views, vectors):
        assert view.dtype == dtype and view.tolist() == list(want)
        assert view.data_ptr() % ALIGN_BYTES == 0
        assert view.untyped_storage().data_ptr() == base and view.untyped_storage().nbytes() == storage.nbytes()
        start = view.storage_offset() * view.element_size()
        assert (base + start) % ALIGN_BYTES == 0
        assert start >= end  # after the previous view: no overlap
        end = start + view.numel() * view.element_size()
    assert end <= storage.nbytes()


@pytest.mark.parametrize("dtype,torch_dtype", [(np.int64, torch.int64), (np.int32, torch.int32)])
@pytest.mark.parametrize("order", [LENGTHS, tuple(reversed(LENGTHS)), (3, 0, 5, 1, 17, 0)])
def test_every_view_holds_its_vector_on_a_16_byte_boundary_of_one_tensor(dtype, torch_dtype, order):
    vectors = [list(range(100 * i + 1, 100 * i + 1 + n)) for i, n in enumerate(order)]
    check_packed(packed(vectors, dtype, "cpu"), vectors, torch_dtype)


def test_numpy_vectors_and_negative_values():
    """The vectors may be numpy arrays (as build passes them); values survive the copy, sign included."""
    vectors = [np.array([-1, 7, 2**40], dtype=np.int64), np.arange(5, dtype=np.int64)]
    check_packed(packed(vectors, np.int64, "cpu"), [v.tolist() for v in vectors], torch.int64)


# (token ids, context before, block tables, state slots); block size 16. Slots by hand: block * 16 + pos % 16.
LAYOUTS = {
    "1+2+4 tokens": (
        [[5], [6, 7], [8, 9, 10, 11]], [3, 0, 17], [[4], [2], [7, 9]], [2, 0, 1],
        dict(input_ids=[5, 6, 7, 8, 9, 10, 11],
             positions=[3, 0, 1, 17, 18, 19, 20],
             slot_mapping=[4 * 16 + 3, 2 * 16 + 0, 2 * 16 + 1, 9 * 16 + 1, 9 * 16 + 2, 9 * 16 + 3, 9 * 16 + 4],
             logits_rows=[0, 2, 6], query_start_t=[0, 1, 3, 7], seq_lens_t=[4, 2, 21], state_slots=[2, 0, 1])),
    "1+2+3+3 tokens": (
        [[1], [2, 3], [4, 5, 6], [7, 8, 9]], [0, 15, 30, 1], [[3], [6, 1], [0, 5, 11], [8]], None,
        dict(input_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9],
             positions=[0, 15, 16, 30, 31, 32, 1, 2, 3],
             slot_mapping=[3 * 16, 6 * 16 + 15, 1 * 16 + 0, 5 * 16 + 14, 5 * 16 + 15, 11 * 16 + 0, 8 * 16 + 1,
                           8 * 16 + 2, 8 * 16 + 3],
             logits_rows=[0, 2, 5, 8], query_start_t=[0, 1, 3, 6, 9], seq_lens_t=[1, 17, 33, 4])),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_build_lays_out_odd_token_counts_aligned_with_the_values_by_hand(name):
    tokens, before, tables, states, want = LAYOUTS[name]
    """Every int64 vector (ids, positions, slots, logits rows, state slots) and int32 one (query starts,
    sequence lengths) starts 16-byte aligned in its shared tensor and holds the hand-computed values."""
    batch = ForwardBatch.build(tokens, before, tables, 16, state_slots=states)
    for field, values in want.items():
        t = getattr(batch, field)
        assert t.tolist() == values, field
        assert t.data_ptr() % ALIGN_BYTES == 0, f"{field} starts {t.data_ptr() % ALIGN_BYTES} bytes off"
    assert (batch.state_slots is None) == (states is None)
    longs = [batch.input_ids, batch.positions, batch.slot_mapping, batch.logits_rows]
    assert {t.dtype for t in longs} == {torch.int64} and len({t.untyped_storage().data_ptr() for t in longs}) == 1
    ints = [batch.query_start_t, batch.seq_lens_t]
    assert {t.dtype for t in ints} == {torch.int32} and len({t.untyped_storage().data_ptr() for t in ints}) == 1
    assert batch.query_start == tuple(want["query_start_t"]) and batch.seq_lens == tuple(want["seq_lens_t"])
