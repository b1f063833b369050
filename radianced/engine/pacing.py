"""How many tokens the next step may take: the flag's budget, or less where measured step times say.

Two caps, both from the steps the daemon runs:

- **A step's time.** `--max-num-batched-tokens` bounds a step's tokens (the receipt
  charges its workspace), but not its time. On a slow device a full step of prefill is
  long: SmolLM2 on a 2-core CPU took about 15 s for 2,048 tokens, and a request that
  arrived, or a cancel, waited that long for the step to end (issue 19, finding 4). The
  next step's tokens are capped at what the measured prefill rate does in
  `--max-step-seconds` (0.5 s by default); a fast device (every GPU) never reaches it.
  The rate is the largest prefill step's so far, or a full step's at the cap, or one's over
  the target: a small step's time is mostly fixed cost, and its rate through zero says far
  fewer tokens fit than do (on the H200 the daemon's own warm-up prompts of 3-17 tokens, ~4
  ms a step, said 375: the first user prompt of 551 tokens took 3 steps, 11.6 ms of device
  time, against one of 5.9 ms for its twin). On a CPU the warm-up's largest prompt (65
  tokens) already gives the rate: SmolLM2's first prompt of 2,000 tokens runs in 6 steps of
  ~0.44 s on the 2-core CPU, not one of 3.1 s.
- **Running streams' inter-token latency.** While sequences decode, a step that also
  prefills delays each of their next tokens by its prefill's time. Uncapped, a burst of
  long prompts on the H200 took steps of 2,048 tokens between 1.7 ms decode steps (issue
  18). So a step with decodes in it takes at most the prefill tokens that keep it within
  `--itl-factor` decode steps' time, by a line fitted to recent prefill steps' times
  (fixed seconds + seconds a token; vLLM's chunked prefill leaves this to
  --max-num-batched-tokens; Sarathi-Serve sizes its chunks to the decode latency the same
  way). The line is fitted to steps beside decodes only: on the H200 a prefill alone (up
  to 2,048 tokens, nobody decoding) gave a line whose fixed part (~12 ms) said no chunk
  could keep a 1.5 ms decode's streams within the target, whatever small chunks cost
  beside decodes. Where the fixed part alone leaves less than a block's worth of the target (an
  eager step beside graph-replayed decodes: about 7 ms against 2-3 on the H200's 8-layer
  synthetic model), the target cannot be met, and smaller chunks would stretch the
  burst's prefill over many steps and save the streams little: a first version fitted no
  fixed part, and on the H200 its burst of 8 x 2,000 tokens prefilled at the floor, 24
  tokens a step, for 7.1 s. There a step takes the fixed part's worth of tokens (it is
  half prefill). Until the line is known the allowance starts at one block and doubles.

Where the engine replays mixed CUDA graphs (engine/graphs.py), a step beside decodes also
takes at most the largest one's tokens (past it the step runs eagerly, and an eager step's
launches cost the H200's 8-layer synthetic model about 7-12 ms whatever its size, against
a decode step's 1.6 ms), and at most BESIDE_DECODES tokens: there a MoE step that prefills
reads nearly every expert, so its fixed part alone is about the target (3.8 ms beside 1.5 ms
decodes at --itl-factor 2.5), and the half-prefill rule above doubled it. Measured on the
H200 (bench/README, session 17), 4 streams decoding while 8 prompts of 2,000 tokens
arrive: with graphs up to 2,048 tokens and no such cap, 11 steps of ~1,450 tokens, 8.9 ms
each, the streams' ITL p99 15.2x the median (the burst in 0.13 s); with steps beside
decodes kept to 256 tokens, 161 steps of 3.8 ms, 4.1x (the burst in 0.63 s). A prefill
with nobody decoding takes the whole budget in one graph.

Each step is timed on its own (engine/step_timer.py); a decode step's time is the
baseline. Each cap grows at most twofold a step, so one short step never sends the next
one over its target. The floor is a step that still decodes every live sequence and
moves a prefill on by a block.
"""

from __future__ import annotations

from radianced.config import Config
from radianced.sizing import BLOCK_TOKENS

FORGET = 0.8  # the weight of a prefill step in the step-time line falls by this with each newer one
BESIDE_DECODES = 256  # the most tokens a step with decodes takes where the engine replays graphs (docstring)


class StepPacer:
    """The next step's token budget from measured step times."""

    def __init__(self, max_tokens: int, max_step_seconds: float, floor: int, itl_factor: float = 0.0,
                 graph_tokens: int = 0):
        """max_tokens: --max-num-batched-tokens (never exceeded); max_step_seconds: the target step
        time (0: no cap); floor: the fewest tokens a paced step may take; itl_factor: the longest a
        step with decodes may take, in decode steps (0: no cap; else above 1); graph_tokens: the
        largest mixed graph's tokens (0: none), a step with decodes' cap too where itl_factor is set."""
        if max_tokens < 1 or max_step_seconds < 0 or floor < 1 or not (itl_factor == 0 or itl_factor > 1) \
                or graph_tokens < 0:
            raise ValueError(f"max_tokens {max_tokens}, max_step_seconds {max_step_seconds}, floor {floor}, "
                             f"itl_factor {itl_factor}, graph_tokens {graph_tokens}")
        self.max_tokens = max_tokens
        self.graph_tokens = graph_tokens
        self.max_step_seconds = max_step_seconds
        self.floor = min(floor, max_tokens)
        self.itl_factor = itl_factor
        self.budget = max_tokens  # the step-time cap
        self._rate, self._rate_tokens = 0.0, 0  # prefill tokens a second, and the step's tokens it was measured on
        self.decode_seconds = 0.0  # the latest decode-only step's time (0: none yet)
        self._fit = [0.0] * 5  # prefill steps' (n: prefill tokens, t: seconds), weighted: sums of 1, n, n², t, nt
        self.prefill_beside_decodes = BLOCK_TOKENS  # prefill tokens a step with decodes may take

    def observe(self, tokens: int, sequences: int, seconds: float, decoding: int = 0, decodes: int = 0) -> int:
        """A finished step of `tokens` tokens over `sequences` sequences, `decodes` of them decoding, took
        `seconds`; returns the next step's budget, for `decoding` sequences decoding in it."""
        if seconds > 0 and tokens <= sequences:
            self.decode_seconds = seconds
        elif seconds > 0:
            if self.max_step_seconds:
                if tokens >= min(self._rate_tokens, self.budget) or seconds > self.max_step_seconds:
                    self._rate, self._rate_tokens = tokens / seconds, tokens  # the step that says the most
                fits = int(self._rate * self.max_step_seconds)
                self.budget = max(self.floor, min(self.max_tokens, fits, 2 * max(tokens, self.budget)))
            prefill = tokens - sequences
            if decodes:  # the line is a step beside decodes (module docstring)
                self._fit = [FORGET * old + new for old, new in
                             zip(self._fit, (1.0, prefill, prefill * prefill, seconds, prefill * seconds))]
            if self.itl_factor and self.decode_seconds:
                grown = 2 * max(prefill, self.prefill_beside_decodes)
                self.prefill_beside_decodes = max(1, min(self._fits(), grown))
        return self.next_budget(decoding)

    def step_line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds a prefill token) of a step that prefills beside decodes, fitted to the recent ones
        (each older step weighs FORGET times less), or None until their sizes differ enough to say."""
        s1, sn, snn, st, snt = self._fit
        spread = s1 * snn - sn * sn
        if spread <= 1e-9 * max(1.0, snn * s1):
            return None
        per_token = (s1 * snt - sn * st) / spread
        return ((st - per_token * sn) / s1, per_token) if per_token > 0 else None

    def _fits(self) -> int:
        """Prefill tokens beside decodes: what keeps the step within --itl-factor decode steps; where that
        is under a block, the fixed cost's worth instead (the step half prefill: module docstring)."""
        line = self.step_line()
        if line is None:
            return self.max_tokens  # not known yet: the growth bound alone
        fixed, per_token = line
        fits = (self.itl_factor * self.decode_seconds - fixed) / per_token
        return int(fits if fits >= BLOCK_TOKENS else fixed / per_token)

    def next_budget(self, decoding: int) -> int:
        """The next step's budget with `decoding` sequences decoding in it."""
        if not (decoding and self.itl_factor and self.decode_seconds):
            return self.budget
        beside = self.prefill_beside_decodes
        if self.graph_tokens:  # the step stays in a mixed graph, and short (module docstring)
            beside = min(beside, min(self.graph_tokens, BESIDE_DECODES) - decoding)
        return min(self.budget, max(self.floor, decoding + beside))

    @classmethod
    def for_config(cls, cfg: Config, graph_tokens: int = 0) -> StepPacer:
        """The daemon's pacer: --max-num-batched-tokens, --max-step-seconds, --itl-factor, a floor of a
        decode for every sequence plus one block of prefill, and the engine's largest mixed graph."""
        return cls(cfg.max_num_batched_tokens, cfg.max_step_seconds, cfg.decode_tokens + BLOCK_TOKENS,
                   cfg.itl_factor, graph_tokens)
