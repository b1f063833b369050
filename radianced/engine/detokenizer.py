"""Token ids -> streamed text, one `IncrementalDetokenizer` per sequence.

Two things are held back from the stream until they are settled:

- bytes that do not yet form whole characters. A byte-level BPE model emits a
  Korean syllable or an emoji as several tokens; each alone decodes to U+FFFD.
  Text is decoded over a short window of tokens (`_prefix`..end) and the part
  past the window's already-emitted text is released only when it does not end
  in U+FFFD. Decoding a window, not single tokens, also keeps decoders that
  strip a leading space (SentencePiece's Metaspace) from eating real spaces.
- text that could still be the start of a stop string. If the text ends with
  "4" and a stop string is "42.", the "4" waits for the next token.

Stop strings are matched on the text, so a stop that spans tokens (or starts
inside one) is cut exactly. When several could match, the one that ends first
wins, and among those the one that starts first; the result does not depend on
how tokens are split into `add` calls. The match (`StopStrings`) runs on the
event loop, so it costs time linear in the new text whatever the stops'
lengths: the check it replaced tried every prefix of every stop against the
text's end, quadratic in a stop's length per token (one 1 MB stop string held
the loop 17.7 s per token).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from radianced.engine.sampling_params import SamplingParams
from radianced.model.tokenizer import Tokenizer

PROMPT_CONTEXT = 5  # prompt tokens decoded ahead of the output, for tokenizers whose decode depends on context
_INCOMPLETE = "\ufffd"


@dataclass(frozen=True)
class TextDelta:
    text: str  # new text to stream (may be empty)
    stop: str | None = None  # the stop string that ended the sequence, if one did in this call


class IncrementalDetokenizer:
    """The text of one sequence's output, released as it becomes final.

    `add(ids)` takes the newly generated ids and returns the text they settle;
    `finish()` releases whatever is held when the sequence ends for another
    reason (stop token, max_tokens). After a stop string matches, the sequence is
    done: `add` and `finish` return nothing more. Not thread-safe; one per sequence.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 include_stop: bool = False, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stops = StopStrings(stop)
        self._include_stop = include_stop
        self._ids = list(prompt_ids[-PROMPT_CONTEXT:])
        self._prefix = 0  # window start: decode(ids[_prefix:_read]) is already in _text
        self._read = len(self._ids)  # ids before this are decoded into _text
        self._text = ""  # output text decoded so far (whole characters only)
        self._emitted = 0  # characters of _text already returned
        self.stopped: str | None = None  # the stop string that ended the sequence

    @classmethod
    def for_request(cls, tokenizer: Tokenizer, params: SamplingParams,
                    prompt_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        return cls(tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output,
                   params.skip_special_tokens)

    @property
    def text(self) -> str:
        """Everything returned so far."""
        return self._text[: self._emitted]

    def add(self, token_ids: Iterable[int]) -> TextDelta:
        """Append generated ids; return the text now final (and the stop string, if one matched)."""
        if self.stopped is not None:
            return TextDelta("", None)
        self._ids.extend(token_ids)
        before = len(self._text)
        self._decode(final=False)
        return self._release(before, final=False)

    def finish(self) -> TextDelta:
        """The sequence ended without a stop string: release everything held, incomplete bytes as U+FFFD."""
        if self.stopped is not None:
            return TextDelta("", None)
        before = len(self._text)
        self._decode(final=True)
        return self._release(before, final=True)

    def _decode(self, final: bool) -> None:
        done = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        full = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(full) > len(done) and (final or not full.endswith(_INCOMPLETE)):
            self._text += full[len(done) :]
            self._prefix, self._read = self._read, len(self._ids)

    def _release(self, before: int, final: bool) -> TextDelta:
        match = self._stops.feed(self._text[before:])
        if match is not None:
            end, s = before + match[0], match[1]
            self.stopped = s
            self._text = self._text[: end if self._include_stop else end - len(s)]
            return self._take(len(self._text), s)
        hold = 0 if final else self._stops.held
        return self._take(len(self._text) - hold, None)

    def _take(self, upto: int, stop: str | None) -> TextDelta:
        upto = max(upto, self._emitted)
        delta, self._emitted = self._text[self._emitted : upto], upto
        return TextDelta(delta, stop)


class StopStrings:
    """The first stop string in a text fed piece by piece, in time linear in the text.

    One Knuth-Morris-Pratt automaton per stop: each stop's state is the length of
    its longest prefix that ends the text so far, and a character advances it in
    amortized constant time whatever the stop's length. Set-up is linear in the
    stops' total length.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)

    def feed(self, text: str) -> tuple[int, str] | None:
        """Advance over `text`. The first match ending in it, as (its end offset in `text`,
        the stop), the longest (earliest starting) of those ending at one place; None if no
        stop ends in `text`. After a match the state is spent (the sequence has ended)."""
        if not self.stops:
            return None
        stops, fail, state = self.stops, self._fail, self._state
        for i, c in enumerate(text):
            found = None
            for j, s in enumerate(stops):
                k = state[j]
                while k and s[k] != c:
                    k = fail[j][k - 1]
                if s[k] == c:
                    k += 1
                if k == len(s):
                    if found is None or len(s) > len(found):
                        found = s
                    k = fail[j][k - 1]
                state[j] = k
            if found is not None:
                return i + 1, found
        return None

    @property
    def held(self) -> int:
        """Characters at the end of the text so far that could still begin a stop string."""
        return max(self._state, default=0)


def _failure(s: str) -> list[int]:
    """KMP's failure function: f[i] is the length of the longest proper prefix of s[: i + 1]
    that is also its suffix."""
    f, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f
