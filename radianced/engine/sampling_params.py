"""What a request asks of decoding: one frozen, validated `SamplingParams`.

Defaults are OpenAI's (temperature 1, top_p 1, no penalties); the names and the
extras (top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, ...) are
vLLM's, so OpenAI and vLLM clients both map onto it field by field. Bad values
fail at construction with `InvalidSamplingParams`, a message naming the field,
the allowed range and the value given (the server turns it into a 400).
"""

from __future__ import annotations

import math

import msgspec

GREEDY_TEMPERATURE = 1e-5  # below this, temperature means greedy (dividing by it would overflow)
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit


class InvalidSamplingParams(ValueError):
    """A sampling field is out of range; the message names the field and what would work."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick each next token and when to stop.

    temperature: 0 is greedy; otherwise logits are divided by it. top_p keeps the
    smallest set of most likely tokens whose mass reaches top_p; top_k keeps the
    k most likely (0 or -1: all); min_p drops tokens less likely than min_p times
    the most likely one. seed makes the request's samples reproducible: the same
    seed, logits and history give the same tokens alone or in any batch.

    Penalties (OpenAI and vLLM semantics): repetition_penalty r divides a positive
    logit by r and multiplies a negative one by r for every token that appears in
    the prompt or the output so far (1 disables); frequency_penalty subtracts
    f * (times the token appeared in the output) and presence_penalty subtracts
    p once if it appeared in the output at all (0 disables; prompt tokens are not counted).

    logprobs: None reports none; n >= 0 reports the chosen token's log-probability
    and the n most likely tokens' (the model's raw distribution, before penalties,
    temperature and filtering, as vLLM reports by default).

    Stops: any of stop_token_ids, the model's end-of-sequence ids unless
    ignore_eos, any of the `stop` strings (the text is cut before it unless
    include_stop_str_in_output), or max_tokens generated (None: up to the context).
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Accept the spellings callers write (a single stop string, lists) and store tuples.
        if isinstance(self.stop, str):
            msgspec.structs.force_setattr(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            msgspec.structs.force_setattr(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            msgspec.structs.force_setattr(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def _check(p: SamplingParams) -> None:
    def fail(field: str, rule: str, value) -> None:
        raise InvalidSamplingParams(f"{field} must be {rule}, got {value!r}")

    def number(field: str, value) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            fail(field, "a finite number", value)
        return value

    def integer(field: str, value) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(field, "an integer", value)
        return value

    if p.max_tokens is not None and integer("max_tokens", p.max_tokens) < 1:
        fail("max_tokens", ">= 1 (or null for up to the context length)", p.max_tokens)
    if number("temperature", p.temperature) < 0:
        fail("temperature", ">= 0 (0 is greedy)", p.temperature)
    if not 0 < number("top_p", p.top_p) <= 1:
        fail("top_p", "in (0, 1]", p.top_p)
    if integer("top_k", p.top_k) < -1:
        fail("top_k", ">= 1, or 0 / -1 to disable", p.top_k)
    if not 0 <= number("min_p", p.min_p) <= 1:
        fail("min_p", "in [0, 1]", p.min_p)
    if p.seed is not None and not -(2**63) <= integer("seed", p.seed) < 2**64:
        fail("seed", "a 64-bit integer", p.seed)
    if number("repetition_penalty", p.repetition_penalty) <= 0:
        fail("repetition_penalty", "> 0 (1 disables)", p.repetition_penalty)
    for field in ("frequency_penalty", "presence_penalty"):
        if not -2 <= number(field, getattr(p, field)) <= 2:
            fail(field, "in [-2, 2]", getattr(p, field))
    for s in p.stop:
        if not isinstance(s, str) or not s:
            fail("stop", "a list of non-empty strings", p.stop)
    for t in p.stop_token_ids:
        if integer("stop_token_ids", t) < 0:
            fail("stop_token_ids", "token ids >= 0", p.stop_token_ids)
    if p.logprobs is not None and not 0 <= integer("logprobs", p.logprobs) <= MAX_LOGPROBS:
        fail("logprobs", f"in [0, {MAX_LOGPROBS}] (or null for none)", p.logprobs)
