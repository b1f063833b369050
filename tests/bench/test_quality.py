"""The quality check's comparison, and the stored SmolLM2 reference."""

from __future__ import annotations

from radianced.bench.quality import Reference, compare

REF = Reference("m", "test", "p", [1, 2], [10, 11, 12], ["The", " sea", "<|im_end|>"])


def test_equal_tokens_match():
    notes = compare(REF, ["The", " sea", "<|im_end|>"])
    assert notes["match"] and notes["first_difference"] is None and notes["got"] == "The sea<|im_end|>"


def test_the_first_differing_token_is_named():
    assert compare(REF, ["The", " sky", "<|im_end|>"])["first_difference"] == 1


def test_a_shorter_or_longer_output_differs_where_one_ends():
    assert compare(REF, ["The", " sea"])["first_difference"] == 2
    assert compare(REF, ["The", " sea", "<|im_end|>", "x"])["first_difference"] == 3


def test_the_smollm2_reference_is_stored_whole():
    ref = Reference.find("smollm2-135m-instruct")
    assert ref is not None and ref.source.startswith("transformers ")
    assert len(ref.token_ids) == len(ref.pieces) and ref.pieces[-1] == "<|im_end|>"
    assert Reference.find("no-such-model") is None
