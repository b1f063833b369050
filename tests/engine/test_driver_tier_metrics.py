"""The driver feeds the tier metrics: disk-tier bytes and one read time per expert read,
arena pages per tenant after every step, and pages moved between tenants.

Tiny Qwen3-MoE through the async driver with a recording metrics object; the
totals it received must equal the slab's and the arena's own counts.
"""

from __future__ import annotations

from collections import Counter

from radianced.arena import EXPERTS, KV
from radianced.budget import plan
from radianced.card import Card
from radianced.config import Config
from radianced.engine.engine_metrics import NoMetrics
from radianced.engine.engine import Engine
from radianced.sizing import ModelFacts
from tests.engine.conftest import prompts, serve_greedy


class TierLog(NoMetrics):
    def __init__(self):
        self.disk_bytes = 0
        self.disk_reads: list[float] = []
        self.pages: list[dict[str, int]] = []  # the gauges after each call that set them
        self.moved: Counter = Counter()

    def add_expert_disk_reads(self, nbytes, seconds) -> None:
        self.disk_bytes += nbytes
        self.disk_reads += seconds

    def set_arena_pages(self, tenant: str, pages: int) -> None:
        if not self.pages or tenant in self.pages[-1]:
            self.pages.append({})
        self.pages[-1][tenant] = pages

    def add_pages_moved(self, src: str, dst: str, pages: int) -> None:
        self.moved[(src, dst)] += pages


async def test_disk_reads_are_counted_once_each(tiny_rads):
    rad = tiny_rads["qwen3_moe"]
    cfg = Config(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, host_pool_mib=0,
                 weights_disk_tier=True, expert_slots=4)
    engine = Engine.build(rad, cfg, Card.from_mib(256))
    slab = engine.experts
    start_reads, start_bytes = slab.stats.disk_reads, slab.stats.disk_bytes  # the slots' start fill
    metrics = await serve_greedy(engine, prompts(rad.model.vocab_size, (9, 30), seed=7), 6, TierLog())
    reads = slab.stats.disk_reads - start_reads
    assert reads > 0 and metrics.disk_bytes == slab.stats.disk_bytes - start_bytes == reads * slab.extent_bytes
    assert len(metrics.disk_reads) == reads and all(t > 0 for t in metrics.disk_reads)
    assert slab.drain_disk_latencies() == []  # the driver took every one


async def test_arena_pages_and_moves_match_the_arena(tiny_rads):
    """34 arena pages, every expert's home in the host pool: four long requests make KV take
    expert slots back, later steps give them back (test_lending's set-up)."""
    rad = tiny_rads["qwen3_moe"]
    cfg = Config(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, host_pool_mib=1)
    probe = plan(Card.from_mib(1024), ModelFacts.from_header(rad.header), cfg)
    size = probe.card_total - probe.elastic + 34 * probe.page_bytes
    engine = Engine.build(rad, cfg, Card(size, size))
    arena = engine.arena
    metrics = await serve_greedy(engine, prompts(rad.model.vocab_size, (100, 104, 108, 112), seed=31), 24,
                                 TierLog())
    assert metrics.moved[(EXPERTS, KV)] > 0
    assert dict(metrics.moved) == {k: v for k, v in arena.stats().moved if v}
    assert metrics.pages[0] == {KV: 0, EXPERTS: 24}  # set when the driver starts, before any step
    assert metrics.pages[-1] == {KV: arena.held(KV), EXPERTS: arena.held(EXPERTS)}
    assert min(p[EXPERTS] for p in metrics.pages) < 24
