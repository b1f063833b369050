"""Start-up warm-up: every kernel variant a served step can meet, built before the daemon is ready.

A Triton kernel compiles once per variant, and a variant first met on the request
path costs 0.1-1 s of somebody's TTFT (kernels/compiles.py). The kernels keep
the set of variants small and a function of the step's shape alone:

- counts (tokens, sequences, assignments, rows) are plain integers to the
  compiler (`do_not_specialize`), and a step's index vectors each start on a
  16-byte boundary (`model.batch.packed`), so neither a count's value nor an
  offset makes a variant;
- what does (constexprs) comes from bucketed counts: the tile sizes of the
  MoE, norm, linear and attention kernels follow the next power of two of the
  step's tokens (clamped), and a decode-shaped step (a token per sequence) splits
  its keys by its sequence count;
- fla-core's prefill autotunes once per model (its keys hold head counts and
  dims, not lengths).

So `warm_up` serves, before ready, a bounded set of real requests through the
engine (scheduler, batch, runner, sampler: the served path), random token ids:

- one sequence of T tokens for T = 1, 2, 4, ... up to --max-num-batched-tokens
  and the limit itself, and one of T + 1: a prefill step of each token bucket,
  then its decode (a hybrid model ends a prompt's first chunk on the last whole
  block before its end, for its state checkpoint: T tokens run as T - 16 and 16
  there, T + 1 as T and 1);
- B one-token sequences together for B = 2 .. --max-num-seqs: the decode-shaped
  step of each sequence count (eager; decode graphs were captured already), then
  B decodes;
- the same with every sampling feature on (temperature, top-k/p, min-p,
  penalties, logprobs, a seed) at B = 1 and 2, one greedy beside;
- with --speculative, B = 1 and 2 sequences whose every decode step drafts N
  tokens (`forced_drafting`: a random-weights model or an unmatched prompt would
  leave n-gram drafting idle), so verify steps run, and a hybrid's per-position
  state kernels with them.

Then it drops the prefix-cache blocks these left, zeroes the expert slab's counts
(the status, the metrics and a saved expert profile count served traffic only),
drops the last step's sampling tensors,
and calls cuBLAS once at every row bucket of every dense projection shape the
steps met (kernels/gemm.py: its first call at a row count costs 3-5 ms on the
H200). `WarmupReport` is what the
start-up log says. The GPU tests (tests/gpu/test_no_compile.py) hold the
claim: no kernel build while serving prompts of random lengths.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from radianced.budget import PlanError
from radianced.engine.drafting import DraftPlanner
from radianced.engine.engine_metrics import NoMetrics
from radianced.engine.request import Request
from radianced.engine.sampling_params import SamplingParams
from radianced.engine.speculation import ngram_drafts
from radianced.kernels import gemm

GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, seed=1, repetition_penalty=1.1,
                         frequency_penalty=0.2, presence_penalty=0.1, logprobs=3, max_tokens=3, ignore_eos=True)
SPECULATIVE = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SERVED_GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
CPU_WARMUP_TOKENS = 32  # the CPU's warm-up prompts: its first-use costs need no long ones (`warm_up_start`)


@dataclass(frozen=True)
class Round:
    """Requests served together: their prompt lengths and parameters (one per request)."""

    lengths: tuple[int, ...]
    params: tuple[SamplingParams, ...]
    drafting: bool = False  # every decode step drafts --speculative N tokens (`forced_drafting`)


@dataclass(frozen=True)
class WarmupReport:
    """What the warm-up did (the start-up log's line; the kernel builds are counted by kernels/compiles.py)."""

    rounds: int  # `Round`s served, one after another
    steps: int  # engine steps they took
    seconds: float  # wall time of the whole warm-up
    tokens: int  # prompt tokens prefilled
    gemms: int  # cuBLAS calls at every row bucket of every dense shape the steps met (kernels/gemm.py)


def token_buckets(limit: int) -> list[int]:
    """1, 2, 4, ... below `limit`, then `limit`: one step size in each power-of-two bucket."""
    sizes, t = [], 1
    while t < limit:
        sizes.append(t)
        t *= 2
    return sizes + [limit]


def plan_rounds(max_batched_tokens: int, max_num_seqs: int, max_model_len: int, speculative: int) -> list[Round]:
    """The warm-up's requests (module docstring), each prompt fitting the context with room to decode."""
    room = max(1, max_model_len - SPECULATIVE.max_tokens - 1)  # the longest prompt that leaves room to decode
    longest = min(max_batched_tokens, room)
    lengths = sorted({n for t in token_buckets(longest) for n in (t, t + 1) if n <= room})
    rounds = [Round((n,), (GREEDY,)) for n in lengths]
    rounds += [Round((1,) * b, (GREEDY,) * b) for b in range(2, max_num_seqs + 1)]
    rounds += [Round((5,), (SAMPLED,))]
    if max_num_seqs >= 2:
        rounds += [Round((5, 7), (SAMPLED, GREEDY))]
    if speculative:
        n = min(48, longest)
        rounds += [Round((n,) * b, (SPECULATIVE,) * b, drafting=True) for b in range(1, min(2, max_num_seqs) + 1)]
    return rounds


def forced_drafting(planner: DraftPlanner) -> DraftPlanner:
    """`planner` with every decode drafting its N tokens: not adaptive, and n-gram drafts proposed from the
    sequence's own last tokens (a match is not needed to verify); the MTP head's drafts as they come."""
    policy = planner.policy
    propose = policy.propose if policy.propose is not ngram_drafts else (lambda seq, n: tuple(seq.token_ids[-n:]))
    return dataclasses.replace(planner, policy=dataclasses.replace(policy, adaptive=False, propose=propose))


def warm_up(engine, max_batched_tokens: int, max_num_seqs: int, max_model_len: int, speculative: int,
            vocab_size: int) -> WarmupReport:
    """Serve `plan_rounds`' requests on `engine` (stepped here; nothing else may step it yet), then
    drop the prefix-cache blocks they left."""
    rng = random.Random(0)
    start, steps, tokens = time.perf_counter(), 0, 0
    rounds = plan_rounds(max_batched_tokens, max_num_seqs, max_model_len, speculative)
    scheduler = engine.scheduler
    planner = scheduler.drafting
    for r, rnd in enumerate(rounds):
        for i, (n, params) in enumerate(zip(rnd.lengths, rnd.params)):
            engine.add(Request(f"warm-up-{r}-{i}", tuple(rng.randrange(vocab_size) for _ in range(n)), params))
            tokens += n
        if rnd.drafting and planner is not None:
            scheduler.drafting = forced_drafting(planner)
        try:
            while scheduler.has_unfinished:
                engine.step()
                steps += 1
        finally:
            scheduler.drafting = planner
    forget(engine)
    gemms = gemm.warm_up()
    return WarmupReport(len(rounds), steps, time.perf_counter() - start, tokens, gemms)


def warm_up_start(engine, cfg, device: str, vocab_size: int, step_thread, compiles) -> str:
    """The daemon's start-up warm-up: `warm_up` on `step_thread`, the thread that will run the served
    steps (a thread's first steps pay its own set-up: torch's CPU thread team, cuBLAS's handle), before
    ready. On CUDA up to --max-num-batched-tokens, every kernel variant and cuBLAS row bucket a step can
    meet; on the CPU (no kernels to build) prompts up to CPU_WARMUP_TOKENS. Returns the start-up log's
    line; a step that runs out of card memory is a PlanError naming the flags to change."""
    before = compiles.count() if compiles is not None else 0
    tokens = min(cfg.max_num_batched_tokens, CPU_WARMUP_TOKENS) if device == "cpu" else cfg.max_num_batched_tokens
    try:
        r = step_thread.submit(warm_up, engine, tokens, cfg.max_num_seqs, engine.receipt.max_model_len,
                               cfg.speculative, vocab_size).result()
    except torch.OutOfMemoryError as e:  # the receipt's workspace line fell short of a real step
        raise PlanError(f"the warm-up's steps (up to --max-num-batched-tokens {cfg.max_num_batched_tokens} "
                        f"tokens, --max-num-seqs {cfg.max_num_seqs}) ran out of card memory the receipt left "
                        f"them ({str(e).splitlines()[0]}); lower --max-num-batched-tokens, or raise "
                        "--gpu-headroom-mib") from None
    said = (f"warm-up: {r.rounds} rounds, {r.steps} steps, {r.tokens} prompt tokens, {r.gemms} cuBLAS row "
            f"buckets in {r.seconds:.1f} s")
    if compiles is not None:
        built = compiles.builds[before:]
        tuned = sum(1 for b in built if b.kind == "autotune")
        said += (f"; {len(built)} kernel variants built ({len(built) - tuned} compiles, {tuned} autotuner keys), "
                 f"{compiles.count()} in all since start-up")
    return said


async def warm_up_served(engine, vocab_size: int, then: Callable[[], Awaitable[object]] | None = None) -> None:
    """Two short requests (greedy, and every sampling feature) through the running `AsyncEngine`, as the
    HTTP API submits them, then one of --max-num-batched-tokens + 1 tokens (two chunks; on the CPU
    CPU_WARMUP_TOKENS + 1), then `then` (the daemon's requests through its own socket,
    server/self_warmup.py), before ready:
    `warm_up` steps the engine synchronously, so the served path's own first uses (the driver's rounds
    on its step thread, a step planned ahead, its input read from the step before on
    the device, the detokenizer, streams) still fell on the first request. Not counted: the metrics are
    off while they run, their prefix-cache blocks are dropped, and the slab's and arena's counts restart
    after them."""
    metrics, engine.metrics = engine.metrics, NoMetrics()
    rng = random.Random(1)
    scheduler, cpu = engine.scheduler, engine.engine.runner.device.type == "cpu"
    longest = (CPU_WARMUP_TOKENS if cpu else scheduler.max_num_batched_tokens) + 1
    if scheduler.max_model_len is not None:
        longest = min(longest, scheduler.max_model_len - SERVED_GREEDY.max_tokens)
    try:
        await asyncio.gather(*(_drain(engine.generate([rng.randrange(vocab_size) for _ in range(n)], params,
                                                      f"warm-up-served-{i}"))
                               for i, (n, params) in enumerate(((9, SERVED_GREEDY), (5, SAMPLED)))))
        await _drain(engine.generate([rng.randrange(vocab_size) for _ in range(longest)], SERVED_GREEDY,
                                     "warm-up-served-long"))
        if then is not None:
            await then()
    finally:
        engine.metrics = metrics
    await engine.between_steps(lambda: (forget(engine.engine), engine.restart_counts()))


def forget(engine) -> None:
    """Drop what warm-up requests left in `engine`: their prefix-cache blocks, the expert slab's counts (the
    status, the metrics and a saved profile count served traffic only) and the runner's last sampling
    tensors (penalty histories: allocated past the receipt's state)."""
    prefix = engine.scheduler.prefix
    prefix.evict(prefix.evictable())
    if engine.experts is not None:
        engine.experts.reset_counts()
        if engine.runner.workers is not None:  # --tp: the other cards' routing counts too
            engine.runner.workers.restart_counts()
    engine.runner.forget_sampling()


async def _drain(chunks) -> None:
    async for _ in chunks:
        pass
