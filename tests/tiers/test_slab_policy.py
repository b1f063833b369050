"""The slot policy under a skewed router: it converges on the hot experts and then stops
refilling (a refill costs as much as the miss it saves).

4 routed layers x 32 experts, all homed in the host pool, 32 slots (25% coverage),
pre-filled in file order (layer 0's experts: the wrong ones). Each step routes one
token's top-4 per layer, drawn from a Zipf(1.0) popularity over a per-layer permutation.
"""

from __future__ import annotations

import numpy as np
import torch

from radianced.arena import Arena
from radianced.tiers.placement import place
from radianced.tiers.slab import ExpertSlab

LAYERS, EXPERTS, K, SLOTS, WIDTH = 4, 32, 4, 32, 1024


def zipf_router(rng: np.random.Generator) -> tuple[list[np.ndarray], np.ndarray]:
    """Per layer: expert ids by popularity rank, and the rank probabilities."""
    p = 1.0 / np.arange(1, EXPERTS + 1)
    return [rng.permutation(EXPERTS) for _ in range(LAYERS)], p / p.sum()


def test_slots_converge_on_the_hot_experts_and_stop_churning():
    rng = np.random.default_rng(0)
    order, p = zipf_router(rng)
    keys = [(layer, e) for layer in range(LAYERS) for e in range(EXPERTS)]
    placement = place(keys, pinned=0, host=len(keys), disk=0, slots=SLOTS)
    host = torch.arange(len(keys), dtype=torch.float32).repeat_interleave(WIDTH).reshape(len(keys), WIDTH)
    slab = ExpertSlab(Arena(SLOTS, WIDTH * 4), WIDTH, torch.float32, placement, host, None, EXPERTS)
    refills, hits, lookups = [], 0, 0
    for step in range(600):
        slab.begin_step([(0, 1)], 1)
        for layer in range(LAYERS):
            ranks = rng.choice(EXPERTS, size=K, replace=False, p=p)
            slab.prepare(layer, torch.from_numpy(order[layer][ranks]).unsqueeze(0))
        (lookups_s, hits_s, _, _), = slab.end_step()
        refills.append(slab.rebalance())
        if step >= 400:
            hits, lookups = hits + hits_s, lookups + lookups_s
    # each slotted expert's row is its host row (the copy is right), and there are at most SLOTS
    for (layer, e) in slab.slotted():
        assert float(slab.slab[slab._slot_of[(layer, e)]][0]) == layer * EXPERTS + e
    assert slab.num_slots == SLOTS
    # the best static choice keeps each layer's 8 most popular experts: P(a routed expert is among them)
    inclusion = _inclusion(p, K, rng)
    ideal = inclusion[:SLOTS // LAYERS].sum() / K
    assert hits / lookups >= 0.85 * ideal, (hits / lookups, ideal)
    assert sum(refills[400:]) / 200 < 0.5, sum(refills[400:]) / 200  # it settled: rarely a refill a step


def _inclusion(p: np.ndarray, k: int, rng: np.random.Generator, draws: int = 20000) -> np.ndarray:
    """P(rank r is among k drawn without replacement), estimated."""
    counts = np.zeros(len(p))
    for _ in range(draws // 10):
        counts[rng.choice(len(p), size=k, replace=False, p=p)] += 1
    return counts / (draws // 10)
