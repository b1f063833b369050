"""N-gram prompt lookup: draft tokens from the sequence's own history.

The drafter of `--speculative-method ngram` (vLLM's "prompt lookup decoding").
A sequence that repeats what it has read (an edit of a given text, code that
reuses names) continues a suffix it has seen before: find the most recent
earlier occurrence of its last k tokens, for k from `max_n` down to `min_n`,
and propose the tokens that followed it. No model, so it drafts for every
family. The search is `bytes.rfind` over the ids as 4-byte words (C speed: a
4,000-token history costs microseconds), checked for word alignment.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

MIN_N = 2  # a single-token match proposes noise (measured acceptance well below the break-even)
MAX_N = 4


def propose(token_ids: Sequence[int], num_drafts: int, min_n: int = MIN_N, max_n: int = MAX_N) -> tuple[int, ...]:
    """Up to `num_drafts` tokens that followed an earlier occurrence of the history's longest matching
    suffix (k tokens, `max_n` >= k >= `min_n`): the most recent occurrence with `num_drafts` tokens after
    it, else the one with the most (in a run of one token, the most recent is followed by one); () when
    none matches."""
    if num_drafts <= 0 or len(token_ids) <= min_n:
        return ()
    words = array("i", token_ids).tobytes()
    total = len(token_ids)
    for k in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = words[-4 * k:]
        best = 0  # where the longest continuation found so far starts (0: none)
        end = len(words) - 4  # an occurrence must end before the suffix's own last token
        while (at := words.rfind(suffix, 0, end)) >= 0:
            end = at + 4 * k - 1
            if at % 4:
                continue  # straddles two ids
            best = at // 4 + k  # the token after the match; each earlier one has a longer continuation
            if total - best >= num_drafts:
                break
        if best:
            return tuple(token_ids[best:best + num_drafts])
    return ()
