"""Compare a radianced model with Hugging Face transformers, step by step.

The reference's greedy tokens drive both models (teacher forcing), so one near
tie cannot derail the rest of the comparison. At every step the logits must
agree within `tol` of max |logit|, and our argmax must equal the reference's
token unless the reference's top-2 gap is below `tie` (either token is right).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.greedy import greedy_generate


@dataclass
class OracleResult:
    worst_rel_err: float  # max over steps of max|ours - ref| / max|ref|
    ties: int  # steps where the reference's top-2 gap was below the tie threshold


def reference_greedy(hf_model, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """The reference's greedy tokens and the logits [V] that chose each (transformers' own KV cache)."""
    tokens, logits = [], []
    ids, past = torch.tensor([prompt]), None
    with torch.inference_mode():
        for _ in range(steps):
            out = hf_model(ids, cache=past, use_cache=True)
            step_logits = out.logits[0, -1].float()
            tok = int(step_logits.argmax())
            tokens.append(tok)
            logits.append(step_logits)
            ids, past = torch.tensor([[tok]]), out.cache
    return tokens, logits


def compare_with_reference(model, cache, hf_model, prompts: list[list[int]], steps: int,
                           tol: float = 1e-4, tie: float = 1e-4) -> OracleResult:
    refs = [reference_greedy(hf_model, p, steps) for p in prompts]
    forced = [r[0] for r in refs]
    trace = greedy_generate(model, cache, prompts, steps, forced=forced)
    worst, ties = 0.0, 0
    for step in range(steps):
        ours = trace.logits[step]  # [B, V]
        for b, (ref_tokens, ref_logits) in enumerate(refs):
            ref = ref_logits[step]
            err = float((ours[b] - ref).abs().max() / ref.abs().max())
            worst = max(worst, err)
            assert err < tol, f"seq {b} step {step}: logits differ by {err:.2e} of max|logit|"
            top2 = ref.topk(2).values
            if float(top2[0] - top2[1]) < tie:
                ties += 1
                continue
            assert int(ours[b].argmax()) == ref_tokens[step], f"seq {b} step {step}: greedy token differs"
    return OracleResult(worst_rel_err=worst, ties=ties)


def compare_prefill_rows(model, cache, hf_model, prompts: list[list[int]], tol: float = 1e-4) -> float:
    """Prefill all prompts in one batch and compare the logits of every prompt row."""
    from radianced.kv.blocks import BlockAllocator
    from radianced.model.batch import ForwardBatch

    alloc = BlockAllocator.fixed(cache.num_blocks, cache.block_size)
    tables = [alloc.new_table() for _ in prompts]
    for table, p in zip(tables, prompts):
        alloc.append(table, len(p))
    if cache.states is not None:
        for b in range(len(prompts)):
            cache.states.reset(b)
    batch = ForwardBatch.build(prompts, [0] * len(prompts), [t.ids() for t in tables], cache.block_size,
                               logits="all", state_slots=list(range(len(prompts))))
    with torch.inference_mode():
        ours = model.forward(batch, cache)  # [sum(len), V]
        refs = torch.cat([hf_model(torch.tensor([p])).logits[0].float() for p in prompts])
    err = float(((ours - refs).abs().max(-1).values / refs.abs().max(-1).values).max())
    assert err < tol, f"prefill logits differ by {err:.2e} of max|logit|"
    return err
