"""Batched greedy decoding without a scheduler.

All sequences are prefilled in one step, then decoded in lockstep, one token
each per step. This is the model oracle's driver: the tests compare it with
transformers on the CPU and the GPU. Serving goes through the engine's
scheduler instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radianced.kv.blocks import BlockAllocator
from radianced.kv.cache import KVCache
from radianced.model.batch import ForwardBatch


@dataclass
class GreedyTrace:
    tokens: list[list[int]]  # generated ids per sequence
    logits: list[torch.Tensor] = field(default_factory=list)  # per step: [B, V] (prefill: last row)


def greedy_generate(model, cache: KVCache, prompts: list[list[int]], max_new_tokens: int,
                    forced: list[list[int]] | None = None, stop_ids: tuple[int, ...] = ()) -> GreedyTrace:
    """Greedy continuation of each prompt; `forced[b]` (teacher forcing) overrides the pick.

    Sequence b uses recurrent-state slot b (the cache needs len(prompts) slots on
    hybrid models). Sequences stop early on any of `stop_ids` (the stop token is kept).
    """
    alloc = BlockAllocator.fixed(cache.num_blocks, cache.block_size)
    tables = [alloc.new_table() for _ in prompts]
    done = [0] * len(prompts)  # tokens already in the cache
    pending = [list(p) for p in prompts]
    trace = GreedyTrace(tokens=[[] for _ in prompts])
    live = list(range(len(prompts)))
    if cache.states is not None:
        for b in live:
            cache.states.reset(b)
    for step in range(max_new_tokens):
        for b in live:
            alloc.append(tables[b], done[b] + len(pending[b]))
        batch = ForwardBatch.build([pending[b] for b in live], [done[b] for b in live],
                                   [tables[b].ids() for b in live], cache.block_size, state_slots=live,
                                   device=cache.storage.device)
        with torch.inference_mode():
            logits = model.forward(batch, cache)  # [B, V]
        trace.logits.append(logits.cpu())
        picks = logits.argmax(-1).tolist()
        for row, b in enumerate(live):
            done[b] += len(pending[b])
            tok = forced[b][step] if forced is not None else picks[row]
            trace.tokens[b].append(tok)
            pending[b] = [tok]
        live = [b for b in live if trace.tokens[b][-1] not in stop_ids]
        if not live:
            break
    return trace
