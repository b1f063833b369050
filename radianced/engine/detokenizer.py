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
how tokens are split into `add` calls.
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
        self._stops = tuple(stop)
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
        text = self._text
        cut = None  # (end, start, stop) of the first-ending match that ends in the new text
        for s in self._stops:
            i = text.find(s, max(0, before - len(s) + 1))
            if i >= 0 and (cut is None or (i + len(s), i) < cut[:2]):
                cut = (i + len(s), i, s)
        if cut is not None:
            end, start, s = cut
            self.stopped = s
            self._text = text[: end if self._include_stop else start]
            return self._take(len(self._text), s)
        hold = 0 if final else max((k for s in self._stops for k in range(1, len(s))
                                    if text.endswith(s[:k])), default=0)
        return self._take(len(text) - hold, None)

    def _take(self, upto: int, stop: str | None) -> TextDelta:
        upto = max(upto, self._emitted)
        delta, self._emitted = self._text[self._emitted : upto], upto
        return TextDelta(delta, stop)
