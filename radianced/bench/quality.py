"""The quality check: the daemon's greedy output against a stored reference for its model.

A reference is `references/<served model name>.json`, written once by
`tools/make_bench_reference.py` from transformers' greedy decoding (fp32) of a
fixed chat prompt: the prompt's token ids, the generated token ids, and each
id's text as the reference tokenizer decodes it alone. The HTTP API returns no
token ids, so the check compares token by token through those texts: each
streamed token's logprobs entry is the daemon's decoding of that one id. A
different id decodes to a different text for every token in SmolLM2's output,
so equal texts mean equal ids here; the reference records its own ids so the
claim can be rechecked.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REFERENCES = Path(__file__).parent / "references"


@dataclass(frozen=True)
class Reference:
    """A model's greedy output for one prompt, from an independent implementation."""

    model: str  # the served model name it applies to
    source: str  # who produced it (library, version, dtype)
    prompt: str  # the user message, for people reading the file
    prompt_ids: list[int]  # the chat-templated prompt as token ids (what the bench sends)
    token_ids: list[int]  # the greedy output, ending with the end-of-turn token when it came
    pieces: list[str]  # tokenizer.decode([id]) for each output id

    @staticmethod
    def find(model: str, folder: Path = REFERENCES) -> Reference | None:
        path = folder / f"{model}.json"
        if not path.is_file():
            return None
        return Reference(**json.loads(path.read_text(encoding="utf-8")))


def compare(ref: Reference, pieces: Sequence[str]) -> dict:
    """The quality row's notes: match, the first differing position (None when equal), both texts."""
    first = next((i for i, (a, b) in enumerate(zip(ref.pieces, pieces)) if a != b), None)
    if first is None and len(pieces) != len(ref.pieces):
        first = min(len(pieces), len(ref.pieces))
    return {"reference": ref.source, "match": first is None, "first_difference": first,
            "tokens_expected": len(ref.pieces), "tokens_got": len(pieces),
            "expected": "".join(ref.pieces), "got": "".join(pieces)}
