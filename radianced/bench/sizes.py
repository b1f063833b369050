"""How big each workload is: the issue's sizes, sized down by --quick, capped by the daemon's limits.

The default mode runs the issue's sizes (4K and 16K prefill, c = 1..16, the
overload burst); --quick keeps every workload but shrinks prompts and outputs
so the whole run takes about a minute on a CPU with SmolLM2-135M; --full adds
the stability pass (at least ten minutes). Prompts never pass the daemon's
context length: a prefill row that had to be capped says so by its prompt
length, which the report prints.
"""

from __future__ import annotations

from dataclasses import dataclass

SWEEP = (1, 2, 4, 8, 16)
OVERLOAD_EXCESS = 32  # requests beyond --max-num-seqs + --max-queue in the burst (each should get a 429)
STABILITY_MIN_S = 600.0


@dataclass(frozen=True)
class DaemonLimits:
    """The serving flags the workloads depend on (the daemon's, or what --url's user says they are)."""

    max_num_seqs: int  # sequences decoded at once
    max_queue: int  # requests waiting beyond the free sequence slots before 429
    max_model_len: int  # context length: prompt + output

    @property
    def admissible(self) -> int:
        """Requests the daemon takes at once when none has finished: free slots plus the queue."""
        return self.max_num_seqs + self.max_queue


@dataclass(frozen=True)
class Sizes:
    """Token counts and request counts of every workload in one run."""

    decode_prompt: str  # the short prompt of the decode row
    decode_tokens: int  # output tokens of the decode row
    decode_requests: int  # sequential requests in the decode row
    prefill_lengths: tuple[int, ...]  # prompt tokens of the prefill rows (one output token each)
    sweep: tuple[int, ...]  # concurrency levels
    sweep_rounds: int  # requests per level = level * rounds
    sweep_prompt_tokens: int
    sweep_tokens: int  # output tokens per sweep request
    overload_requests: int  # sent at once: admissible + OVERLOAD_EXCESS
    overload_tokens: int  # output tokens per admitted request: long enough that none ends before the burst is in
    turn_prompt_tokens: int  # approximate length of the first turn's user message
    turn_tokens: int  # output tokens per turn
    stability_s: float  # 0: no stability pass
    stability_concurrency: int

    @staticmethod
    def choose(limits: DaemonLimits, quick: bool, full: bool, stability_s: float = STABILITY_MIN_S) -> Sizes:
        """The sizes of a run; `stability_s` applies with `full` only."""
        max_len = limits.max_model_len
        prefill = (128, 256) if quick else (4096, 16384)
        sweep_prompt, sweep_tokens = (32, 16) if quick else (256, 128)
        sweep = tuple(c for c in SWEEP if c <= limits.admissible)
        return Sizes(
            decode_prompt="Write a short story about a lighthouse keeper.",
            decode_tokens=32 if quick else 256, decode_requests=1 if quick else 3,
            prefill_lengths=tuple(min(n, max_len - 2) for n in prefill), sweep=sweep,
            sweep_rounds=1 if quick else 4, sweep_prompt_tokens=min(sweep_prompt, max_len // 2),
            sweep_tokens=min(sweep_tokens, max_len // 2),
            overload_requests=limits.admissible + OVERLOAD_EXCESS,
            overload_tokens=min(32 if quick else 256, max_len // 2),
            turn_prompt_tokens=min(160 if quick else 2048, max_len // 3), turn_tokens=16 if quick else 128,
            stability_s=max(stability_s, STABILITY_MIN_S) if full else 0.0,
            stability_concurrency=min(8, limits.max_num_seqs),
        )
