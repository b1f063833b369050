"""One batched sampling call per step: logits [B, V] -> next tokens, logprobs.

The runner builds `SamplingTensors` from the step's rows (each request's
`SamplingParams` and token history) and calls `Sampler.sample` once. Every
stage is a [B, V] tensor op; stages no row asks for are skipped on host flags
computed at build time, so the hot path reads no device value.

Order (vLLM's): penalties -> (greedy rows: argmax) -> temperature -> min_p ->
top_k -> top_p (on the distribution renormalized after min_p and top_k) ->
softmax -> exponential race. The race picks argmax(p_i / E_i) with
E_i = -log(U_i) ~ Exp(1), which is a draw from p (the Gumbel-max trick in
probability space) and needs no cumulative sum or host sync. The argmaxes are
`ops.argmax` (one Triton launch on CUDA, torch's elsewhere).

Seeds. Unseeded rows share one [B, V] uniform draw from the sampler's generator.
A seeded row's noise for its n-th output token comes from a generator seeded
with mix(seed, n): the same seed, logits and history give the same token
whether the request runs alone or in any batch at any row, and after a
preemption or a rolled-back draft, since nothing is carried between steps.
torch has no per-row-seeded batched RNG, so this costs one `rand(V)` launch per
seeded row (a loop over seeded rows, never over the vocabulary). The batched
alternative is a counter-based hash of (seed, n, vocab index) in integer tensor
ops: one launch for all rows and device-independent, but a few dozen elementwise ops
over [B, V]; worth it if seeded rows become common or sampling is graph-captured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from radianced.engine.plan import PENDING
from radianced.engine.sampling_params import SamplingParams
from radianced.kernels import ops
from radianced.model.batch import to_device_no_sync

_MASK64 = (1 << 64) - 1


class SamplingRow(NamedTuple):
    """One sequence of the step: its params and the tokens it has so far."""

    params: SamplingParams
    output_ids: Sequence[int]  # generated so far; the next token is output index len(output_ids)
    prompt_ids: Sequence[int] = ()  # only read for repetition_penalty


@dataclass(frozen=True)
class SamplingTensors:
    """A step's sampling parameters as [B]-shaped tensors, plus host flags that skip unused stages."""

    temperature: torch.Tensor  # [B] fp32; 1 on greedy rows
    greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor  # [B] int64; V where off
    top_p: torch.Tensor  # [B] fp32; 1 where off
    min_p: torch.Tensor  # [B] fp32; 0 where off
    # penalties (None when no row has any)
    repetition_penalty: torch.Tensor | None  # [B] fp32
    frequency_penalty: torch.Tensor | None  # [B] fp32
    presence_penalty: torch.Tensor | None  # [B] fp32
    seen: torch.Tensor | None  # [B, V] bool: token in the prompt or the output
    output_counts: torch.Tensor | None  # [B, V] fp32: times the token is in the output
    # host data
    seeded: tuple[tuple[int, int], ...]  # (row, generator seed for this step's token)
    num_logprobs: int | None  # top-N to report: max over rows; None when no row wants logprobs
    all_greedy: bool
    max_top_k: int  # 0 when no row uses top_k
    do_top_p: bool
    do_min_p: bool

    @property
    def do_penalties(self) -> bool:
        return self.seen is not None

    @classmethod
    def build(cls, rows: Sequence[SamplingRow | tuple], vocab_size: int, device: torch.device | str = "cpu",
              pending: tuple[torch.Tensor, torch.Tensor] | None = None) -> SamplingTensors:
        """The batched form of `rows` (one per sequence, in logits row order).

        Host work is O(B + tokens of rows with penalties); the copies
        to `device` do not wait for work queued on its stream. A row whose last output id
        is PENDING (a step in flight samples it) has it in `pending`: (rows [P], ids [P])
        on the device, for the penalties' counts.
        """
        rows = [SamplingRow(*r) for r in rows]
        ps = [r.params for r in rows]
        b = len(ps)

        def floats(values) -> torch.Tensor:
            return to_device_no_sync(torch.tensor(values, dtype=torch.float32), device)

        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in ps]
        # the [B] parameters in two host-to-device copies (each costs the host ~20 us), neither waiting
        # for the stream (a step may be in flight): fp32 rows temperature | top_p | min_p, int64
        # columns top_k | greedy
        real = floats([[1.0 if p.greedy else p.temperature for p in ps], [p.top_p for p in ps],
                       [p.min_p for p in ps]]).view(3, b)
        ints = to_device_no_sync(torch.tensor([[k, p.greedy] for k, p in zip(top_k, ps)],
                                              dtype=torch.int64).view(b, 2), device)

        penalties = {}
        if any(p.has_penalties for p in ps):
            penalties = dict(
                repetition_penalty=floats([p.repetition_penalty for p in ps]),
                frequency_penalty=floats([p.frequency_penalty for p in ps]),
                presence_penalty=floats([p.presence_penalty for p in ps]),
                **_histories(rows, vocab_size, device, pending),
            )
        wanted = [p.logprobs for p in ps if p.logprobs is not None]
        return cls(
            temperature=real[0],
            greedy=ints[:, 1] != 0,
            top_k=ints[:, 0],
            top_p=real[1],
            min_p=real[2],
            repetition_penalty=penalties.get("repetition_penalty"),
            frequency_penalty=penalties.get("frequency_penalty"),
            presence_penalty=penalties.get("presence_penalty"),
            seen=penalties.get("seen"),
            output_counts=penalties.get("output_counts"),
            seeded=seeded_rows(rows),
            num_logprobs=max(wanted) if wanted else None,
            all_greedy=all(p.greedy for p in ps),
            max_top_k=max((k for k, p in zip(top_k, ps) if k < vocab_size and not p.greedy), default=0),
            do_top_p=any(p.top_p < 1 and not p.greedy for p in ps),
            do_min_p=any(p.min_p > 0 and not p.greedy for p in ps),
        )


def seeded_rows(rows: Sequence[SamplingRow]) -> tuple[tuple[int, int], ...]:
    """(row, generator seed for this step's token) of the seeded sampling rows: host data that
    changes every step (the seed follows the output length), unlike the tensors."""
    return tuple((i, _stream_seed(r.params.seed, len(r.output_ids)))
                 for i, r in enumerate(rows) if r.params.seed is not None and not r.params.greedy)


def _histories(rows: list[SamplingRow], vocab_size: int, device,
               pending: tuple[torch.Tensor, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """seen [B, V] (prompt or output) and output_counts [B, V], scattered on `device` from the
    rows' token ids (one copy of the ids; no [B, V] tensor on the host). An output id that is
    PENDING (a step in flight samples it) is counted from `pending`: (rows [P], ids [P]) on the
    device."""
    out, prompt = [], []  # (row, id) pairs
    for i, r in enumerate(rows):
        if r.params.has_penalties:
            out += [(i, t) for t in r.output_ids if t != PENDING]
            prompt += [(i, t) for t in r.prompt_ids]
    pairs = to_device_no_sync(torch.tensor(out + prompt, dtype=torch.int64).view(-1, 2), device)
    counts = torch.zeros((len(rows), vocab_size), dtype=torch.float32, device=device)
    counts.index_put_((pairs[:len(out), 0], pairs[:len(out), 1]), torch.ones((), device=device).expand(len(out)),
                      accumulate=True)
    if pending is not None:
        counts.index_put_(pending, torch.ones((), device=device).expand(len(pending[0])), accumulate=True)
    seen = counts > 0
    seen[pairs[len(out):, 0], pairs[len(out):, 1]] = True
    return {"seen": seen, "output_counts": counts}


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _stream_seed(seed: int, index: int) -> int:
    """The generator seed for output token `index` of a request seeded with `seed`."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ index)


@dataclass(frozen=True)
class SampleResult:
    """One step's picks, on the logits' device (the runner copies them to the host once)."""

    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] fp32: the chosen token's raw log-probability
    top_ids: torch.Tensor | None  # [B, N] int64, most likely first; row b uses its own first logprobs[b]
    top_logprobs: torch.Tensor | None  # [B, N] fp32


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Repetition, then frequency, then presence penalties; returns new logits [B, V] (input untouched)."""
    if not t.do_penalties:
        return logits
    r = t.repetition_penalty[:, None]
    x = torch.where(t.seen, torch.where(logits > 0, logits / r, logits * r), logits)
    x = x - t.frequency_penalty[:, None] * t.output_counts
    return x - t.presence_penalty[:, None] * (t.output_counts > 0)


def apply_filters(x: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """min_p, then top_k, then top_p on temperature-scaled logits [B, V]; dropped tokens become -inf.

    The most likely token always survives. Ties with the k-th largest logit are
    kept (as vLLM keeps them). top_p keeps the tokens whose strictly-more-likely
    mass is below top_p: the smallest prefix that reaches it.
    """
    if t.do_min_p:  # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p)
        x = x.masked_fill(x < x.max(dim=-1, keepdim=True).values + t.min_p.log()[:, None], float("-inf"))
    if t.do_top_p:
        xs, order = x.sort(dim=-1, descending=True)
        if t.max_top_k:
            xs = xs.masked_fill(xs < xs.gather(1, (t.top_k - 1)[:, None]), float("-inf"))
        p = xs.softmax(dim=-1)
        before = p.cumsum(dim=-1) - p  # mass of the tokens sorted ahead
        xs = xs.masked_fill((before >= t.top_p[:, None]) & (t.top_p < 1)[:, None], float("-inf"))
        return x.scatter(1, order, xs)
    if t.max_top_k:
        kth = x.topk(t.max_top_k, dim=-1).values.gather(1, (t.top_k.clamp(max=t.max_top_k) - 1)[:, None])
        x = x.masked_fill((x < kth) & (t.top_k <= t.max_top_k)[:, None], float("-inf"))
    return x


class Sampler:
    """Samples one token per row from a step's logits. Holds the generators; nothing per request.

    `seed` fixes the unseeded rows' stream (tests, `--deterministic`); None draws
    a fresh one. Seeded rows never touch that stream.
    """

    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None):
        self._noise = torch.Generator(device)
        if seed is None:
            self._noise.seed()
        else:
            self._noise.manual_seed(seed)
        self._row = torch.Generator(device)  # reseeded for every seeded row

    def sample(self, logits: torch.Tensor, t: SamplingTensors) -> SampleResult:
        """logits: [B, V] raw model output (not modified). Returns the picks of all B rows."""
        logits = logits.float()
        x = apply_penalties(logits, t)
        tokens = ops.argmax(x)
        if not t.all_greedy:
            x = apply_filters(x / t.temperature[:, None], t)
            race = x.softmax(dim=-1).div_(self._exponential(x.shape, x.device, t))
            tokens = torch.where(t.greedy, tokens, ops.argmax(race))
        if t.num_logprobs is None:
            return SampleResult(tokens, None, None, None)
        lp = logits.log_softmax(dim=-1)
        top = lp.topk(t.num_logprobs, dim=-1)
        return SampleResult(tokens, lp.gather(1, tokens[:, None])[:, 0], top.indices, top.values)

    def _exponential(self, shape: torch.Size, device: torch.device, t: SamplingTensors) -> torch.Tensor:
        """[B, V] Exp(1) noise: -log(U). U = 0 (odds 2^-24) gives E = inf, so that token scores 0
        (dropped for this draw) instead of winning outright."""
        if len(t.seeded) < shape[0]:
            u = torch.rand(shape, generator=self._noise, device=device)
        else:
            u = torch.empty(shape, device=device)
        for row, seed in t.seeded:  # one launch per seeded row; see the module docstring
            self._row.manual_seed(seed)
            u[row] = torch.rand(shape[1], generator=self._row, device=device)
        return u.log_().neg_()
