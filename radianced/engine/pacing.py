"""How many tokens the next step may take: the flag's budget, or less where measured step times say.

Two caps, both from the steps the daemon runs:

- **A step's time.** `--max-num-batched-tokens` bounds a step's tokens (the receipt
  charges its workspace), but not its time. On a slow device a full step of prefill is
  long: SmolLM2 on a 2-core CPU took about 15 s for 2,048 tokens, and a request that
  arrived, or a cancel, waited that long for the step to end (issue 19, finding 4). The
  next step's tokens are capped at what the measured prefill rate does in
  `--max-step-seconds` (0.5 s by default); a fast device (every GPU) never reaches it.
- **Running streams' inter-token latency.** While sequences decode, a step that also
  prefills delays each of their next tokens by its prefill's time. Uncapped, a burst of
  long prompts on the H200 took steps of 2,048 tokens between 1.7 ms decode steps (issue
  18). So a step with decodes in it takes at most the prefill tokens that fit in
  (`--itl-factor` - 1) decode steps' time beside them, at the prefill rate measured beyond a
  decode step's time: the streams' gaps stay within that factor of their usual, and the
  prefill moves on in smaller chunks (vLLM's chunked prefill leaves this to
  --max-num-batched-tokens; Sarathi-Serve sizes its chunks to the decode latency the same way).
  Until a step with both has been measured, the allowance starts at one block and grows.

Rates come from steps that prefill (more tokens than sequences), each timed on its own
(engine/step_timer.py); a decode step's time (mostly fixed cost) is the baseline. A prefill
token's time beyond it follows a costlier step at once and a cheaper one halfway (a chunk late
in a long prompt attends to more context and costs more than an early one; with the tiny
models on the CPU, an average let the late chunks' steps run 10x a decode step). Each cap grows at
most twofold a step, so one short step never sends the next one over its target. The floor
is a step that still decodes every live sequence and moves a prefill on by a block.
"""

from __future__ import annotations

from radianced.config import Config
from radianced.sizing import BLOCK_TOKENS


class StepPacer:
    """The next step's token budget from measured step times."""

    def __init__(self, max_tokens: int, max_step_seconds: float, floor: int, itl_factor: float = 0.0):
        """max_tokens: --max-num-batched-tokens (never exceeded); max_step_seconds: the target step
        time (0: no cap); floor: the fewest tokens a paced step may take; itl_factor: the longest a
        step with decodes may take, in decode steps (0: no cap; else above 1)."""
        if max_tokens < 1 or max_step_seconds < 0 or floor < 1 or not (itl_factor == 0 or itl_factor > 1):
            raise ValueError(f"max_tokens {max_tokens}, max_step_seconds {max_step_seconds}, floor {floor}, "
                             f"itl_factor {itl_factor}")
        self.max_tokens = max_tokens
        self.max_step_seconds = max_step_seconds
        self.floor = min(floor, max_tokens)
        self.itl_factor = itl_factor
        self.budget = max_tokens  # the step-time cap
        self.decode_seconds = 0.0  # the latest decode-only step's time (0: none yet)
        self.token_seconds: float | None = None  # a prefill token's time beyond a decode step's (averaged)
        self.prefill_beside_decodes = BLOCK_TOKENS  # prefill tokens a step with decodes may take

    def observe(self, tokens: int, sequences: int, seconds: float, decoding: int = 0) -> int:
        """A finished step of `tokens` tokens over `sequences` sequences took `seconds`; returns the
        next step's budget, for `decoding` sequences decoding in it."""
        if seconds > 0 and tokens <= sequences:
            self.decode_seconds = seconds
        elif seconds > 0:
            if self.max_step_seconds:
                fits = int(tokens * self.max_step_seconds / seconds)
                self.budget = max(self.floor, min(self.max_tokens, fits, 2 * max(tokens, self.budget)))
            if self.decode_seconds:
                prefill = tokens - sequences
                cost = max(0.0, seconds - self.decode_seconds) / prefill
                self.token_seconds = cost if self.token_seconds is None else max(cost, (self.token_seconds + cost) / 2)
                room = (self.itl_factor - 1) * self.decode_seconds
                fits = int(room / self.token_seconds) if self.token_seconds else self.max_tokens
                self.prefill_beside_decodes = max(1, min(fits, 2 * max(prefill, self.prefill_beside_decodes)))
        return self.next_budget(decoding)

    def next_budget(self, decoding: int) -> int:
        """The next step's budget with `decoding` sequences decoding in it."""
        if not (decoding and self.itl_factor and self.decode_seconds):
            return self.budget
        return min(self.budget, max(self.floor, decoding + self.prefill_beside_decodes))

    @classmethod
    def for_config(cls, cfg: Config) -> StepPacer:
        """The daemon's pacer: --max-num-batched-tokens, --max-step-seconds, --itl-factor, and a floor
        of a decode for every sequence plus one block of prefill."""
        return cls(cfg.max_num_batched_tokens, cfg.max_step_seconds, cfg.decode_tokens + BLOCK_TOKENS,
                   cfg.itl_factor)
