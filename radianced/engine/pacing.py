"""How many tokens the next step may take: the flag's budget, or what the device does in a step time.

`--max-num-batched-tokens` bounds a step's tokens (the receipt charges its
workspace), but not its time. On a slow device a full step of prefill is long:
SmolLM2 on a 2-core CPU took about 15 s for 2,048 tokens, and a request that
arrived, or a cancel, waited that long for the step to end (issue 19, finding
4). The pacer measures the device's prefill rate from the steps it runs and
caps the next step's tokens at what that rate does in `--max-step-seconds`
(0.5 s by default): a newcomer or a cancel then waits about that long, and a
fast device (every GPU) never reaches the cap, so its steps stay the flag's.

The rate comes from steps that prefill (more tokens than sequences); decode
steps, whose time is mostly fixed cost, say nothing about it. The estimate is
the latest such step's tokens per second, and the budget grows at most twofold
a step, so one short step never sends the next one over the target. The floor
is a step that still decodes every live sequence and moves a prefill on.
"""

from __future__ import annotations

from radianced.config import Config
from radianced.sizing import BLOCK_TOKENS


class StepPacer:
    """The next step's token budget from measured step times."""

    def __init__(self, max_tokens: int, max_step_seconds: float, floor: int):
        """max_tokens: --max-num-batched-tokens (never exceeded); max_step_seconds: the target step
        time (0: no pacing, always max_tokens); floor: the fewest tokens a paced step may take."""
        if max_tokens < 1 or max_step_seconds < 0 or floor < 1:
            raise ValueError(f"max_tokens {max_tokens}, max_step_seconds {max_step_seconds}, floor {floor}")
        self.max_tokens = max_tokens
        self.max_step_seconds = max_step_seconds
        self.floor = min(floor, max_tokens)
        self.budget = max_tokens

    def observe(self, tokens: int, sequences: int, seconds: float) -> int:
        """A finished step of `tokens` tokens over `sequences` sequences took `seconds`; returns the
        next step's budget."""
        if self.max_step_seconds == 0 or tokens <= sequences or seconds <= 0:
            return self.budget
        fits = int(tokens * self.max_step_seconds / seconds)
        self.budget = max(self.floor, min(self.max_tokens, fits, 2 * max(tokens, self.budget)))
        return self.budget

    @classmethod
    def for_config(cls, cfg: Config) -> StepPacer:
        """The daemon's pacer: --max-num-batched-tokens, --max-step-seconds, and a floor of a
        decode for every sequence plus one block of prefill."""
        return cls(cfg.max_num_batched_tokens, cfg.max_step_seconds, cfg.decode_tokens + BLOCK_TOKENS)
