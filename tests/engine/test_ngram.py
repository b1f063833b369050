"""N-gram prompt lookup: the longest suffix, its most recent earlier occurrence, word alignment."""

from __future__ import annotations

from radianced.engine.ngram import propose


def test_the_tokens_after_the_most_recent_earlier_occurrence_of_the_suffix_are_proposed():
    history = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert propose(history, 2) == (7, 8)  # [1, 2, 3] last seen before at 5: followed by 7, 8
    # 10 drafts: the occurrence at 5 has 6 tokens after it, the one at 0 has 11: the longer one
    assert propose(history, 10) == (9, 9, 1, 2, 3, 7, 8, 5, 1, 2)
    assert propose(history[:8], 10) == (9, 9, 1, 2, 3)  # the only occurrence, up to the history's end


def test_the_longest_suffix_wins_over_a_more_recent_shorter_one():
    history = [4, 2, 3, 11, 0, 2, 3, 12, 0, 4, 2, 3]
    assert propose(history, 1, min_n=2, max_n=3) == (11,)  # [4, 2, 3] beats the later [2, 3] -> 12
    assert propose(history, 1, min_n=2, max_n=2) == (12,)


def test_no_match_or_too_short_a_history_proposes_nothing():
    assert propose([1, 2, 3, 4, 5], 3) == ()
    assert propose([1, 1], 3) == ()  # a suffix of min_n=2 needs an earlier occurrence
    assert propose([5, 6, 5, 6], 0) == ()


def test_a_run_of_one_token_continues_itself():
    assert propose([8, 7, 7, 7, 7], 3) == (7,)  # [7, 7, 7] at 1 is followed by the last 7 only
    assert propose([7] * 10, 3) == (7, 7, 7)


def test_a_match_straddling_two_ids_bytes_is_not_a_match():
    a, b = 0x01020304, 0x05060708
    # the bytes of [a, b] (little-endian 04 03 02 01 08 07 06 05) appear unaligned inside x, y
    x, y = 0x03040000 | 0, 0x07080102
    z = 0x00000506
    history = [x, y, z, 42, a, b]
    assert propose(history, 1, min_n=2, max_n=2) == ()
    assert propose([a, b, 42, 5, a, b], 2) == (42, 5)


def test_large_ids_and_long_histories():
    vocab_id = 151_643  # a Qwen3 id
    history = list(range(3000)) + [vocab_id, 17, 18, 19] + list(range(5000, 6000)) + [vocab_id, 17, 18]
    assert propose(history, 4) == (19, 5000, 5001, 5002)
