"""The expert tiers move compact extents as the file holds them (issue 20): a tiny Qwen3-MoE (3 MoE
layers x 16 experts, I = 32, H = 64) converted with `--quantize experts=int8` and `experts=int4`.

Through the engine on the CPU, a slab smaller than all experts with the rest in the host pool, in a
tmpfs pool, or in the file (the disk tier) gives the greedy tokens `ResidentExperts` gives on the same
`.rad`; the receipt's expert slot is the compact extent rounded to 4 KiB, and that is what the arena's
pages, the host pool's rows and the disk tier's reads hold.
"""

from __future__ import annotations

import pytest
import torch

from radianced.card import Card
from radianced.config import Config
from radianced.engine.engine import Engine
from radianced.model.convert import convert
from radianced.model.rad import RadFile
from radianced.model.tiny import make_tiny
from radianced.receipt import fmt_mib
from radianced.tiers.host import HostPool
from tests.engine.conftest import prompts, request, run_all, small_engine

LAYERS, EXPERTS, INTER, HIDDEN = 3, 16, 32, 64
EXTENT = {"q8_0": 3 * INTER * HIDDEN // 32 * 34, "q4_0": 3 * INTER * HIDDEN // 32 * 18}
# Several sequences at once: KV pages share the arena with expert pages, whose compact bytes read as fp32
# are NaN and inf in places; the CPU's batched attention zeroes what lies past each context (it once
# only masked it, and 0 * NaN poisoned the sum: this test's int8 model then gave [0, 0, ...]).
CFG = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)


@pytest.fixture(scope="module", params=[("int8", "q8_0"), ("int4", "q4_0")], ids=["int8", "int4"])
def compact_rad(request, tmp_path_factory):
    scheme, fmt = request.param
    root = tmp_path_factory.mktemp(f"compact_{scheme}")
    src = make_tiny("qwen3_moe", root / "hf", num_experts=EXPERTS, moe_intermediate_size=INTER, hidden_size=HIDDEN)
    convert(src, root / "m.rad", quantize=f"experts={scheme}")
    with RadFile.open(root / "m.rad") as rad:
        assert {(e.dtype, e.nbytes) for e in rad.header.experts} == {(fmt, EXTENT[fmt])}
        yield rad, fmt


@pytest.fixture(scope="module")
def resident_tokens(compact_rad):
    """Greedy tokens of three prompts with every expert in one ResidentExperts slab."""
    rad, _ = compact_rad
    ps = prompts(rad.model.vocab_size, (9, 33, 50), seed=21)
    engine = small_engine(rad)
    assert engine.runner.experts is None  # Engine.assemble without a slab: the loader's ResidentExperts
    return ps, run_all(engine, [request(engine, f"p{i}", p, max_tokens=16) for i, p in enumerate(ps)])


def _tiered(rad: RadFile, **flags) -> Engine:
    return Engine.build(rad, Config(**CFG, **flags), Card.from_mib(256))


@pytest.mark.parametrize("flags", [
    dict(expert_slots=8, host_pool_mib=16),
    dict(expert_slots=4, host_pool_mib=0, weights_disk_tier=True),
], ids=["host_pool", "disk_tier"])
def test_tiered_compact_experts_give_the_resident_tokens(compact_rad, resident_tokens, flags):
    rad, fmt = compact_rad
    ps, want = resident_tokens
    engine = _tiered(rad, **flags)
    slab = engine.experts
    assert slab.slab.dtype == torch.uint8 and slab.num_slots < LAYERS * EXPERTS
    assert all(slab.weight_format(layer) == fmt for layer in range(LAYERS))
    assert run_all(engine, [request(engine, f"p{i}", p, max_tokens=16) for i, p in enumerate(ps)]) == want
    if flags.get("weights_disk_tier"):
        assert slab.stats.disk_reads > 0 and slab.stats.disk_bytes == slab.stats.disk_reads * EXTENT[fmt]
    else:
        assert slab.host.dtype == torch.uint8 and slab.host.shape[1] == EXTENT[fmt]
    for r in engine.resources:
        r.close()


def test_a_tmpfs_host_pool_holds_the_compact_extents(compact_rad, resident_tokens, shm_dir):
    rad, fmt = compact_rad
    ps, want = resident_tokens
    engine = _tiered(rad, expert_slots=8, host_pool_mib=16, host_pool_placement=f"ram={shm_dir}")
    pool = next(r for r in engine.resources if isinstance(r, HostPool))
    assert pool.path is not None and pool.path.parent == shm_dir and pool.dtype == torch.uint8
    key = pool.keys[0]
    assert pool.row(*key).numpy().tobytes() == rad.expert_bytes(*key, verify=True).numpy().tobytes()
    assert run_all(engine, [request(engine, f"p{i}", p, max_tokens=16) for i, p in enumerate(ps)]) == want
    for r in engine.resources:
        r.close()


def test_the_receipts_slot_is_the_compact_extent_and_the_allocation_holds_it(compact_rad):
    rad, fmt = compact_rad
    engine = _tiered(rad, expert_slots=8, host_pool_mib=16)
    receipt, slab = engine.receipt, engine.experts
    pool = next(r for r in engine.resources if isinstance(r, HostPool))
    assert receipt.expert_extent == slab.extent_bytes == EXTENT[fmt]
    slot = (EXTENT[fmt] + 4095) // 4096 * 4096  # the extent rounded up to 4 KiB, or a KV block when larger
    assert receipt.expert_slot == receipt.page_bytes == max(slot, receipt.groups[0].block_bytes)
    assert slab.slab.stride(0) == receipt.page_bytes == engine.arena.page_bytes == pool.row_bytes
    assert engine.arena.storage.numel() == receipt.arena_alloc_bytes
    quant = {"q8_0": "int8, an fp16 scale per 32", "q4_0": "int4, an fp16 scale per 32"}[fmt]
    assert f"expert slot: {fmt_mib(EXTENT[fmt])} extent ({fmt}: {quant}) -> {fmt_mib(receipt.expert_slot)} slot " \
           "(rounded up to 4 KiB)" in receipt.lines()
    assert f"host pool: {fmt_mib(receipt.experts_host * receipt.expert_slot)} used of 16.00 MiB" in receipt.lines()
    for r in engine.resources:
        r.close()

