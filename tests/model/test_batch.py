"""ForwardBatch.build: one step's sequences laid out on one token axis, by hand."""

from __future__ import annotations

import pytest

from radianced.model.batch import ForwardBatch


def test_layout_of_a_mixed_step():
    """A 3-token chunk after 14 cached tokens (it crosses from block 7 into block 2), a decode at
    position 4, and a sequence with no new tokens; block size 8."""
    batch = ForwardBatch.build([[11, 12, 13], [21], []], [14, 4, 9], [[5, 7, 2], [3], [4, 6]], 8,
                               logits=[True, True, True], state_slots=[2, 0, 1])
    assert batch.input_ids.tolist() == [11, 12, 13, 21]
    assert batch.positions.tolist() == [14, 15, 16, 4]
    assert batch.slot_mapping.tolist() == [7 * 8 + 6, 7 * 8 + 7, 2 * 8 + 0, 3 * 8 + 4]
    assert batch.logits_rows.tolist() == [2, 3]  # the empty sequence has no row to sample
    assert batch.query_start == (0, 3, 4, 4) and batch.query_start_t.tolist() == [0, 3, 4, 4]
    assert batch.seq_lens == (17, 5, 9) and batch.seq_lens_t.tolist() == [17, 5, 9]
    assert batch.block_tables.tolist() == [[5, 7, 2], [3, 0, 0], [4, 6, 0]]
    assert batch.state_slots.tolist() == [2, 0, 1]
    assert batch.state_slot_ids == (2, 0, 1)  # the host's copy: a hybrid's per-sequence loop reads no device value
    # the hybrid's verify ops run the decode (slot 0) and leave the chunk and the empty sequence alone
    assert batch.decoding == (False, True, False)
    assert batch.verify_slots.tolist() == [-1, 0, -1]


def test_a_verify_step_runs_its_drafting_sequences_and_its_single_tokens_through_decoding():
    """A verify step (a last token and 2 drafts), a one-token decode, a prompt chunk of 2: the verify ops'
    slots name the first two; a decode-shaped hybrid step needs none (its state slots are theirs)."""
    batch = ForwardBatch.build([[1, 2, 3], [4], [5, 6]], [7, 3, 0], [[0], [1], [2]], 16, state_slots=[4, 1, 0],
                               drafts=[2, 0, 0])
    assert batch.drafts == (2, 0, 0) and batch.decoding == (True, True, False)
    assert batch.verify_slots.tolist() == [4, 1, -1]
    decode = ForwardBatch.build([[1], [4]], [7, 3], [[0], [1]], 16, state_slots=[4, 1])
    assert decode.is_decode and decode.verify_slots is None and decode.decoding == ()
    assert ForwardBatch.build([[1, 2]], [0], [[0]], 16).verify_slots is None  # no recurrent layers


@pytest.mark.parametrize("logits,rows", [("all", [0, 1, 2, 3]), ("last", [1, 3]), ([False, True], [3])])
def test_logits_rows(logits, rows):
    batch = ForwardBatch.build([[1, 2], [3, 4]], [0, 0], [[0], [1]], 16, logits=logits)
    assert batch.logits_rows.tolist() == rows and batch.state_slots is None
    assert batch.every_row == (logits == "all")


def test_a_decode_batch_wants_every_row():
    """One token a sequence, each sampled: the rows are 0 .. T-1 and the forward skips its gather."""
    assert ForwardBatch.build([[1], [2], [3]], [4, 0, 9], [[0], [1], [2]], 16).every_row
    assert not ForwardBatch.build([[1], [2], [3]], [4, 0, 9], [[0], [1], [2]], 16, logits=[True, False, True]).every_row


def test_a_block_table_too_short_for_the_tokens_is_refused():
    """Position 16 needs a third block of 8: without it the slot would be a padding zero."""
    with pytest.raises(ValueError, match=r"sequence 1's block table has 2 blocks; its tokens reach position 16"):
        ForwardBatch.build([[1], [2, 3]], [0, 15], [[4], [5, 6]], 8)


def test_is_decode_needs_one_token_from_every_sequence():
    """Decode-shaped (query_start 0, 1, ..., B) lets attention do RoPE and the KV write in its own
    launch; three tokens over three sequences, one of them feeding two and one none, are not."""
    assert ForwardBatch.build([[1], [2], [3]], [4, 0, 9], [[0], [1], [2]], 16).is_decode
    assert not ForwardBatch.build([[1, 2], [], [3]], [4, 0, 9], [[0], [1], [2]], 16).is_decode
    assert not ForwardBatch.build([[1, 2]], [0], [[0]], 16).is_decode
