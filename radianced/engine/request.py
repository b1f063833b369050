"""A request as the engine receives it, and the scheduler's state of its sequence."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol

from radianced.engine.plan import PENDING
from radianced.engine.speculation import DraftStats
from radianced.kv.blocks import BlockTable


class SamplingParamsLike(Protocol):
    """What the scheduler reads from sampling params (the rest is the sampler's)."""

    max_tokens: int | None  # None: up to the context (the scheduler's max_model_len)


@dataclass(frozen=True)
class Request:
    """One generation: prompt ids, sampling params, and the token ids that end it
    (the engine merges the params' stop ids with the model's end-of-sequence ids)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParamsLike | Any
    stop_token_ids: frozenset[int] = frozenset()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token id was sampled (it is kept in the output)
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled
    ERROR = "error"  # the step could not compute it (an expert read failed); SeqEvent.error says why


class Sequence:
    """The scheduler's state of one request. The engine may read it; only the scheduler writes it.

    token_ids is the prompt followed by the output so far; its last entry is
    `plan.PENDING` while a planned step has yet to sample it. num_computed_tokens
    of them have KV (and, on hybrid models, are folded into the state slot) once
    the steps planned so far ran; after a preemption it drops to 0 and the whole
    of token_ids is computed again.
    """

    def __init__(self, seq_id: int, request: Request, num_groups: int = 1):
        if not request.prompt_token_ids:
            raise ValueError(f"request {request.request_id}: empty prompt")
        self.seq_id = seq_id  # arrival order: older sequences have smaller ids
        self.request = request
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.status = SeqStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.block_table = BlockTable(num_groups)
        self.block_hashes: list[bytes] = []  # prefix-cache keys of token_ids' full blocks
        self.num_cached_blocks = 0  # leading blocks of block_table already offered to the prefix cache
        self.num_computed_tokens = 0
        self.num_reused_tokens: int | None = None  # prompt tokens a prefix hit skipped (first admission)
        self.num_preemptions = 0
        self.state_slot: int | None = None  # hybrid: recurrent-state slot while running
        self.checkpoint: int | None = None  # hybrid: checkpoint slot this sequence owns
        self.checkpoint_tokens = 0  # tokens the owned checkpoint holds the state after (0: none yet)
        self.checkpoint_at = 0  # hybrid: block boundary where this admission's prompt checkpoint is taken
        self.draft_stats = DraftStats()  # speculative decoding: its drafts and their acceptance

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> Any:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than the last sampled token is left to compute."""
        return self.num_computed_tokens < len(self.token_ids) - 1

    @property
    def pending(self) -> bool:
        """Its last token is what a plan in flight samples."""
        return self.token_ids[-1] == PENDING

    def at_length(self, tokens: int, max_model_len: int | None) -> bool:
        """With `tokens` tokens (prompt and output) it reaches max_tokens or max_model_len."""
        max_tokens = self.params.max_tokens
        return max_tokens is not None and tokens - self.num_prompt_tokens >= max_tokens \
            or max_model_len is not None and tokens >= max_model_len

    def land(self, at: int, tokens: tuple[int, ...], max_model_len: int | None,
             ) -> tuple[tuple[int, ...], FinishReason | None]:
        """Put the tokens a step sampled for positions `at`, `at`+1, ... in place of the PENDING one at
        `at` (a verify step yields several); the ones landed (up to the first that ends the sequence:
        a stop token, max_tokens, max_model_len) and why it ends, if it does. The scheduler finishes it."""
        if not tokens or self.token_ids[at] != PENDING or len(tokens) > 1 and len(self.token_ids) != at + 1:
            raise ValueError(f"sequence {self.seq_id} was to sample at {at}, got {tokens}")
        for j, t in enumerate(tokens):  # a plan ahead never follows one that drafts: more than one lands last
            if j:
                self.token_ids.append(t)
            else:
                self.token_ids[at] = t
            if t in self.request.stop_token_ids:
                return tokens[:j + 1], FinishReason.STOP
            if self.at_length(at + j + 1, max_model_len):
                return tokens[:j + 1], FinishReason.LENGTH
        return tokens, None

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, {self.request_id!r}, {self.status.value}, "
                f"computed {self.num_computed_tokens}/{self.num_tokens})")
