"""Exact expert accounting of the slab on a scripted routing sequence (SPEC §9).

Two routed layers of four experts; slots hold (0, 1) and (1, 3), the rest live in
the host pool. A lookup is one (step, layer, expert) a sequence's rows needed, a
hit found it in a slot at that time; routed counts token-to-expert assignments.
"""

from __future__ import annotations

import torch

from radianced.arena import EXPERTS, Arena
from radianced.tiers.placement import place
from radianced.tiers.slab import ExpertSlab

WIDTH = 1024  # fp32: one 4 KiB page per expert
EXPERTS_ = [(layer, e) for layer in (0, 1) for e in range(4)]


def scripted_slab() -> ExpertSlab:
    placement = place(EXPERTS_, pinned=0, host=8, disk=0, slots=2, ranking=[(0, 1), (1, 3)])
    host = torch.arange(8, dtype=torch.float32).repeat_interleave(WIDTH).reshape(8, WIDTH)
    return ExpertSlab(Arena(4, WIDTH * 4), WIDTH, torch.float32, placement, host,
                      None, num_experts=4)


def test_lookups_hits_and_routed_per_layer_and_per_sequence():
    slab = scripted_slab()
    assert slab.slotted() == {(0, 1), (1, 3)} and slab.arena.held(EXPERTS) == 2
    assert slab.extent_bytes == WIDTH * 4
    # rows 0: sequence A; rows 1-2: sequence B; row 3: a prefill row nobody counts per sequence
    slab.begin_step([(0, 1), (1, 3)], 4)
    slab.prepare(0, torch.tensor([[1, 2], [1, 0], [2, 1], [1, 3]]))
    slab.prepare(1, torch.tensor([[3, 0], [3, 2], [3, 2], [0, 1]]))
    per_seq = slab.end_step()
    # A: layer 0 {1 hit, 2 miss}, layer 1 {3 hit, 0 miss}; one assignment each
    # B: layer 0 {1 hit x2, 0 miss, 2 miss}, layer 1 {3 hit x2, 2 miss x2}
    assert per_seq == ((4, 2, 4, 2), (5, 2, 8, 4))
    # the step as a whole: each layer needed all four experts once, one of them in a slot
    assert slab.stats.lookups == {0: 4, 1: 4}
    assert slab.stats.hits == {0: 1, 1: 1}
    assert slab.stats.routed == {0: 8, 1: 8}

    # a step without begin_step counts only the layer totals
    slab.prepare(0, torch.tensor([[1, 2]]))
    assert slab.end_step() == ()
    assert (slab.stats.lookups[0], slab.stats.hits[0], slab.stats.routed[0]) == (6, 2, 10)

    # a hit is judged by the table at that time: once the slots are given up, (0, 1) misses
    slab.surrender(2)
    assert slab.slotted() == frozenset()
    slab.begin_step([(0, 1)], 1)
    slab.prepare(0, torch.tensor([[2, 1]]))
    assert slab.end_step() == ((2, 0, 2, 2),)
    assert (slab.stats.lookups[0], slab.stats.hits[0]) == (8, 2)


def test_two_steps_in_flight_are_counted_apart_and_by_the_table_each_router_saw():
    """Step 1 is launched, the slots are given up, step 2 is launched, then both are counted:
    step 1's routing stays its own and its hits are judged by the table it ran with."""
    slab = scripted_slab()
    slab.begin_step([(0, 1)], 1)
    slab.prepare(0, torch.tensor([[1, 2]]))
    first = slab.end_launch()
    slab.surrender(2)  # between the steps: (0, 1) leaves its slot
    slab.begin_step([(0, 1)], 1)
    routed = torch.tensor([[1, 3]])
    slab.prepare(0, routed)
    second = slab.end_launch()
    routed.fill_(0)  # the step's ids tensor is reused (a graph's static output): the record kept its own
    assert slab.count(first) == ((2, 1, 2, 1),)
    assert slab.count(second) == ((2, 0, 2, 2),)
    assert (slab.stats.lookups[0], slab.stats.hits[0], slab.stats.routed[0]) == (4, 1, 4)


def test_one_row_segments_count_as_the_general_rule_does():
    """Decode steps count each sequence's one row (a router's top-k never repeats an expert in a
    row: the fast path); the same routing split into the general rule's terms, by hand."""
    slab = scripted_slab()
    g = torch.Generator().manual_seed(5)
    ids = {layer: torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(5)]) for layer in (0, 1)}
    slab.begin_step([(0, 1), (2, 3), (4, 5)], 5)
    for layer in (0, 1):
        slab.prepare(layer, ids[layer])
    slotted = slab.slotted()
    want = []
    for row in (0, 2, 4):
        experts = [(layer, int(e)) for layer in (0, 1) for e in ids[layer][row]]
        hits = sum(key in slotted for key in experts)
        want.append((len(experts), hits, len(experts), len(experts) - hits))
    assert slab.end_step() == tuple(want)


def test_one_row_segments_in_any_order_count_their_own_rows():
    """The decode fast path takes every row in order as they are (a graph's decode step), else the
    segments' rows as listed: the same per-row counts either way."""
    g = torch.Generator().manual_seed(6)
    ids = {layer: torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(4)]) for layer in (0, 1)}
    runs = {}
    for order in ((0, 1, 2, 3), (2, 0, 3, 1)):
        slab = scripted_slab()
        slab.begin_step([(r, r + 1) for r in order], 4)
        for layer in (0, 1):
            slab.prepare(layer, ids[layer])
        runs[order] = dict(zip(order, slab.end_step()))
    assert runs[(0, 1, 2, 3)] == runs[(2, 0, 3, 1)]


def test_a_layer_called_twice_in_a_step_counts_each_call():
    """Lookups, hits and misses are per (layer call, distinct expert), as if the calls were layers."""
    slab = scripted_slab()
    slab.begin_step([(0, 1)], 1)
    slab.prepare(0, torch.tensor([[1, 2]]))
    slab.prepare(0, torch.tensor([[1, 3]]))
    assert slab.end_step() == ((4, 2, 4, 2),)  # (0, 1) is in a slot: a hit in each call
    assert (slab.stats.lookups, slab.stats.hits, slab.stats.routed) == ({0: 4, 1: 0}, {0: 2, 1: 0}, {0: 4, 1: 0})
    assert slab.routing == {(0, 1): 2, (0, 2): 1, (0, 3): 1}


def test_a_replayed_stacked_record_counts_as_the_eager_one():
    """A decode graph stacks the routed layers' ids inside its capture (`record`), and each replay
    rewrites that one tensor before `replay` hands it over; padding rows past the counted ones are
    not counted. Stepped pipelined (step N+1 launched, its routing written over the same static
    tensor, before step N is counted) with slots given up between steps, it counts what the eager
    path counts from the same routing."""
    g = torch.Generator().manual_seed(7)
    steps = [{layer: torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(4)]) for layer in (0, 1)}
             for _ in range(6)]
    eager, graphed = scripted_slab(), scripted_slab()
    graphed.begin_step([], 0)  # the dry capture, over a static batch of 4 rows
    for layer in (0, 1):
        graphed.prepare(layer, torch.zeros(4, 2, dtype=torch.int64))
    recording = graphed.record()
    assert recording.ids.shape == (4, 2, 2) and recording.layers == (0, 1)
    assert graphed.end_step() == ()
    counts = {id(eager): [], id(graphed): []}
    pending = {}
    for i, ids in enumerate(steps):
        for slab in (eager, graphed):
            slab.begin_step([(0, 1), (1, 3)], 3)  # row 3 is padding
            if slab is eager:
                for layer in (0, 1):
                    slab.prepare(layer, ids[layer][:3].clone())
            else:
                recording.ids.copy_(torch.stack([ids[0], ids[1]], dim=1))  # what the replay writes
                slab.replay(recording)
            record = slab.end_launch()
            if id(slab) in pending:
                counts[id(slab)].append(slab.count(pending[id(slab)]))
            pending[id(slab)] = record
            if i == 2:
                slab.surrender(1)
    for slab in (eager, graphed):
        counts[id(slab)].append(slab.count(pending[id(slab)]))
    assert counts[id(eager)] == counts[id(graphed)]
    for name in ("lookups", "hits", "routed"):
        assert getattr(eager.stats, name) == getattr(graphed.stats, name)
    assert eager.routing == graphed.routing and (eager.policy._missed == graphed.policy._missed).all()
    assert graphed._copies.made == 2  # two steps in flight at most: their host buffers are reused


def test_one_row_steps_count_as_the_general_rule_does():
    """A batch-1 decode step (one row, every routed layer once, in order) is counted on its R x k
    cells alone; the same routing recorded in another layer order takes the general rule (counted
    over every (call, expert)): the two slabs' counts, stats, scores and slots stay equal as they
    rebalance step after step."""
    layers, experts, k = 4, 32, 4
    keys = [(layer, e) for layer in range(layers) for e in range(experts)]
    slabs = []
    for _ in range(2):
        placement = place(keys, pinned=0, host=len(keys), disk=0, slots=32)
        host = torch.zeros(len(keys), WIDTH)
        slabs.append(ExpertSlab(Arena(32, WIDTH * 4), WIDTH, torch.float32, placement, host, None, experts))
    g = torch.Generator().manual_seed(8)
    popular = torch.linspace(3.0, 0.0, experts).exp()  # skewed, so that slots get refilled and hit
    for _ in range(60):
        ids = [torch.multinomial(popular, k, generator=g).unsqueeze(0) for _ in range(layers)]
        counts = []
        for slab, order in zip(slabs, (range(layers), reversed(range(layers)))):
            slab.begin_step([(0, 1)], 1)
            for layer in order:
                slab.prepare(layer, ids[layer])
            counts.append(slab.end_step())
            slab.rebalance()
        assert counts[0] == counts[1]
    a, b = slabs
    assert (a.stats.lookups, a.stats.hits, a.stats.routed) == (b.stats.lookups, b.stats.hits, b.stats.routed)
    assert a.stats.total_hits > 0 and a.stats.refills > 0
    assert a.routing == b.routing and a.slotted() == b.slotted()
    assert (a.policy._raw == b.policy._raw).all() and (a.policy._missed == b.policy._missed).all()
