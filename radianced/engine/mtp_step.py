"""The MTP head's pass after a step (model/mtp.py has the math), as every card runs it.

On one card the runner builds an `MTPStep` from the step it collects (its plan and samples) and runs
it. Under `--tp N` the head is sharded like a main-model layer (attention by heads, its routed experts
split across the cards, its shared expert by columns, its own KV on every card) so every card runs the
same pass: rank 0 sends the `MTPStep` (engine/tp_workers.py) and each card runs it over the hidden
states its own forward of that step returned, which are the same on every card (whole after the last
all-reduce). The drafts agree too: the head's logits are gathered whole on every card, so each card's
argmax, and so the token each chained step reads, is rank 0's; only rank 0's drafts are used.

Why not draft on rank 0 alone: it would need the whole MTP layer (attention, shared expert and every
routed expert) and its KV for every head on card 0, the card with the least room (tp_memory.py), and
the other cards would idle during it; sharded, a card holds 1/N of it and the pass costs two
all-reduces per chained draft, as a decoder layer does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radianced.kernels import ops
from radianced.kv.cache import KVCache
from radianced.model.batch import ForwardBatch, to_device_no_sync
from radianced.model.layers import CausalLM


@dataclass(frozen=True)
class MTPStep:
    """The head's pass over a step's rows.

    next_ids: the token after each row of the step (its input's next, its sample where it sampled, or
        the chunk's `next_token_id`): the head reads row p's hidden state with it.
    rows: per sampling sequence, the step's row its drafts start from (where the tokens the step
        yields end); positions: those rows' positions; tables: those sequences' block tables (the
        scheduler's lookahead blocks included: chained drafts write their KV there).
    drafts: the drafts chained per sequence at most (--speculative).
    """

    next_ids: list[int]
    rows: list[int]
    positions: list[int]
    tables: list[list[int]]
    drafts: int


def run_mtp(model: CausalLM, cache: KVCache, batch: ForwardBatch, hidden: torch.Tensor,
            step: MTPStep) -> list[tuple[int, ...]]:
    """Run the head over every row of `batch` (hidden [T, H]: the step's final-normed states), writing
    its KV even where nothing samples; each of `step.rows`' drafts: the first at the row, then chained
    (draft k reads the head's normed output for draft k-1 and that draft, one position on, writing its
    KV there), as many as `step.drafts` allows and the sequence's blocks cover."""
    mtp, device, bs = model.mtp, cache.storage.device, cache.block_size
    with torch.inference_mode():
        ids = to_device_no_sync(torch.tensor(step.next_ids, dtype=torch.int64), device)
        x = mtp(ids, hidden, model.rotary.at(batch.positions), batch, cache)
        if not step.rows:
            return []
        x = x[to_device_no_sync(torch.tensor(step.rows, dtype=torch.int64), device)]
        tokens = ops.argmax(mtp.logits(x))
        rooms = [len(table) * bs - 1 - p for table, p in zip(step.tables, step.positions)]
        live = list(range(len(step.rows)))
        chain = [(live, tokens)]  # per chained draft: the sequences it extends, their tokens on the device
        for k in range(1, step.drafts):
            keep = [j for j, i in enumerate(live) if rooms[i] >= k]
            if not keep:
                break
            if len(keep) < len(live):
                at = to_device_no_sync(torch.tensor(keep, dtype=torch.int64), device)
                x, tokens, live = x[at], tokens[at], [live[j] for j in keep]
            chained = ForwardBatch.build([[0]] * len(live), [step.positions[i] + k for i in live],
                                         [step.tables[i] for i in live], bs,
                                         device=device)  # its input ids are unread: the head reads `tokens`
            x = mtp(tokens, mtp.chained(x), model.rotary.at(chained.positions), chained, cache)
            tokens = ops.argmax(mtp.logits(x))
            chain.append((live, tokens))
        # the drafts reach the host once, after the last pass: a read per pass would wait for each
        flat = torch.cat([t for _, t in chain]).tolist()
    drafts: list[list[int]] = [[] for _ in step.rows]
    at = 0
    for seqs, _ in chain:
        for i, t in zip(seqs, flat[at:at + len(seqs)]):
            drafts[i].append(t)
        at += len(seqs)
    return [tuple(d) for d in drafts]
