"""The disk tier through the engine: experts whose home is the model file are read with
io_uring + O_DIRECT when a step routes them, and a read that fails fails only the
requests whose tokens were routed to that expert.

Tiny Qwen3-MoE (24 routed experts) with `--host-pool-mib 0 --weights-disk-tier`:
`--expert-slots 4` leaves most experts in the file; `--expert-slots 0` reads every
routed expert from disk in every step, so a fault hook's one-shot failure lands in
a known step.
"""

from __future__ import annotations

import logging
import shutil


from radianced.card import Card
from radianced.config import Config
from radianced.engine.engine import Engine
from radianced.engine.request import FinishReason
from radianced.model.rad import RadFile
from radianced.tiers.disk import DiskReader
from radianced.tiers.faults import Faults
from radianced.tiers.slab import MISSING
from tests.engine.conftest import prompts, request, run_all


def disk_engine(rad: RadFile, slots: int) -> Engine:
    cfg = Config(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, host_pool_mib=0,
                 weights_disk_tier=True, expert_slots=slots)
    return Engine.build(rad, cfg, Card.from_mib(256))


def run_events(engine: Engine, requests) -> dict[str, list]:
    """Every SeqEvent per request id, stepping until all finish."""
    for r in requests:
        engine.add(r)
    out: dict[str, list] = {}
    while engine.scheduler.has_unfinished:
        for ev in engine.step():
            out.setdefault(ev.request_id, []).append(ev)
    return out


def test_most_experts_on_disk_give_the_resident_tokens(tiny_rads, caplog):
    rad = tiny_rads["qwen3_moe"]
    ps = prompts(rad.model.vocab_size, (9, 33, 50), seed=33)
    resident = Engine.build(rad, Config(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64),
                            Card.from_mib(256))
    want = run_all(resident, [request(resident, f"p{i}", p, max_tokens=16) for i, p in enumerate(ps)])
    with caplog.at_level(logging.INFO, logger="radianced.engine"):
        engine = disk_engine(rad, slots=4)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("disk probe: ") and "GB/s O_DIRECT read of" in line for line in lines)
    assert any(line.startswith("disk tier: 24 experts stay in ") for line in lines)
    assert any(line.startswith("pre-filled 4 slots in file order in ") and "; slot " in line and "verified" in line
               for line in lines)
    slab = engine.experts
    assert engine.receipt.experts_disk == 24 and slab.placement.count("disk") == 24
    assert len(engine.arena.reserved) == 2 * rad.model.num_experts  # two layer buffers of min(E, k x 64 tokens)
    got = run_all(engine, [request(engine, f"p{i}", p, max_tokens=16) for i, p in enumerate(ps)])
    assert got == want
    assert slab.num_slots <= 4
    assert slab.stats.disk_reads > 24 and slab.stats.disk_bytes == slab.stats.disk_reads * slab.extent_bytes
    assert len(slab.drain_disk_latencies()) > 0 and slab.drain_disk_latencies() == []
    # between steps nothing points at a buffer row: unslotted disk experts are MISSING again
    for layer, table in slab._tables.items():
        slotted = {e for (l, e) in slab.slotted() if l == layer}
        assert all((table[e] == MISSING) != (e in slotted) for e in range(rad.model.num_experts))


def test_a_failed_read_fails_only_the_requests_routed_to_that_expert(tiny_rads):
    rad = tiny_rads["qwen3_moe"]
    a, b = prompts(rad.model.vocab_size, (20, 2), seed=7)  # b's 2 tokens route a few experts per layer
    # probe: which experts does each prompt route in the first MoE layer of the first step?
    probe = disk_engine(rad, slots=0)
    calls = []
    prepare = probe.experts.prepare
    probe.experts.prepare = lambda layer, ids: (calls.append((layer, ids.clone())), prepare(layer, ids))[1]
    probe.add(request(probe, "a", a))
    probe.add(request(probe, "b", b))
    probe.step()
    layer, expert = next((layer, min(only_a)) for layer, ids in calls
                         if (only_a := set(ids[:20].flatten().tolist()) - set(ids[20:].flatten().tolist())))
    clean = disk_engine(rad, slots=0)
    want = run_all(clean, [request(clean, "a", a), request(clean, "b", b)])

    engine = disk_engine(rad, slots=0)
    faults = Faults()
    faults.fail(layer, expert)
    engine.experts.loader.reader.faults = faults
    events = run_events(engine, [request(engine, "a", a), request(engine, "b", b)])
    (failed,) = events["a"]
    assert failed.finish_reason is FinishReason.ERROR and failed.token_ids == ()
    assert f"expert (layer {layer}, expert {expert})" in failed.error and "read failed" in failed.error
    assert [t for ev in events["b"] for t in ev.token_ids] == want["b"]
    # the engine goes on: the same prompt again is served in full, and every block came back
    assert run_all(engine, [request(engine, "a2", a)])["a2"] == want["a"]


def test_a_truncated_model_file_fails_the_request_with_a_clear_message(tiny_rads, tmp_path):
    """The disk tier reads a truncated copy (the resident weights stay mapped from the intact file:
    truncating a file under a live mapping would kill any process with SIGBUS)."""
    rad = tiny_rads["qwen3_moe"]
    path = tmp_path / "m.rad"
    shutil.copy(rad.path, path)
    with open(path, "r+b") as f:
        f.truncate(min(e.offset for e in rad.header.experts) + 4096)  # every expert but the first is cut off
    engine = disk_engine(rad, slots=0)
    loader = engine.experts.loader
    loader.reader.close()
    loader.reader = DiskReader.from_rad(rad, path=path)
    (p,) = prompts(rad.model.vocab_size, (12,), seed=3)
    events = run_events(engine, [request(engine, "t", p)])
    (ev,) = events["t"]
    assert ev.finish_reason is FinishReason.ERROR
    assert "short read" in ev.error and "truncated" in ev.error and str(path) in ev.error
    assert not engine.scheduler.has_unfinished
