"""build_expert_slab (tiers/build.py): the tiers a receipt describes, built from a real `.rad`, and
the start-up lines that say so, in order.

The tier tests' model (3 MoE layers x 16 experts, bf16), copied so that a profile can sit beside it.
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from radianced.arena import EXPERTS, Arena
from radianced.budget import plan
from radianced.card import Card
from radianced.sizing import ModelFacts
from radianced.config import Config
from radianced.model.rad import RadFile
from radianced.tiers.build import build_expert_slab
from radianced.tiers.expert_loader import ExpertLoader
from radianced.tiers.host import HostPool
from radianced.tiers.profile import Profile, profile_path

CFG = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)


@pytest.fixture
def rad(tier_rad, tmp_path):
    path = tmp_path / "m.rad"
    shutil.copyfile(tier_rad, path)
    with RadFile.open(path) as rad:
        yield rad


def build(rad: RadFile, caplog, **flags):
    """The slab, its resources and the engine log's lines (closes the resources)."""
    cfg = Config(**CFG, **flags)
    receipt = plan(Card.from_mib(256), ModelFacts.from_header(rad.header), cfg)
    resources: list = []
    with caplog.at_level(logging.INFO, logger="radianced.engine"):
        slab = build_expert_slab(rad, Arena.from_receipt(receipt), receipt, torch.bfloat16, cfg, resources)
    kinds = [type(r) for r in resources]
    for r in resources:
        r.close()
    return slab, kinds, [r.getMessage() for r in caplog.records]


def test_a_host_pool_receipt_fills_the_pool_then_the_slots_in_file_order(rad, caplog):
    slab, kinds, lines = build(rad, caplog, expert_slots=8, host_pool_mib=16)
    assert kinds == [HostPool, ExpertLoader] and slab.arena.held(EXPERTS) == 8
    assert slab.slotted() == {(0, e) for e in range(8)}
    assert lines[0] == "experts: placement: 0 experts pinned on card, 48 in host pool, 0 on disk; 8 cache slots " \
                       "pre-filled"
    assert lines[1].startswith("host pool: 48 experts (") and lines[2].startswith("PCIe probe: ")
    assert lines[3].startswith("pre-filled 8 slots in file order in ") and lines[3].endswith("; slot 0 verified")
    assert len(lines) == 4


def test_a_disk_tier_receipt_probes_the_disk_and_keeps_the_experts_in_the_file(rad, caplog):
    slab, kinds, lines = build(rad, caplog, expert_slots=4, host_pool_mib=0, weights_disk_tier=True)
    assert kinds == [ExpertLoader] and slab.stages_experts and slab.placement.count("disk") == 48
    assert lines[0] == "experts: placement: 0 experts pinned on card, 0 in host pool, 48 on disk; 4 cache slots " \
                       "pre-filled"
    assert lines[1].startswith("PCIe probe: ") and lines[2].startswith("disk probe: ")
    assert lines[3] == f"disk tier: 48 experts stay in {rad.path}, read with O_DIRECT when a step routes them " \
                       f"(buffers: 2 x {len(slab.arena.reserved) // 2} slots)"
    assert lines[4].startswith("pre-filled 4 slots in file order in ") and len(lines) == 5


def test_the_profile_beside_the_model_orders_the_fill(rad, caplog):
    profile = Profile.for_model(rad)
    profile.add(2, [0] * 15 + [7])
    profile.add(1, [0, 0, 3] + [0] * 13)
    profile.save(profile_path(rad.path))
    slab, _, lines = build(rad, caplog, expert_slots=4, host_pool_mib=16)
    assert lines[0] == f"profile {profile_path(rad.path).name}: 2 ranked pairs"
    assert lines[-1].startswith("pre-filled 4 slots from the profile in ")
    assert slab.slotted() == {(2, 15), (1, 2), (0, 0), (0, 1)}  # ranked first, then file order


def test_a_corrupt_profile_is_logged_and_the_fill_goes_on_in_file_order(rad, caplog):
    profile_path(rad.path).write_bytes(b"not a profile")
    slab, _, lines = build(rad, caplog, expert_slots=4, host_pool_mib=16)
    assert lines[0].endswith("; slots are filled in file order")
    assert caplog.records[0].levelno == logging.WARNING
    assert lines[-1].startswith("pre-filled 4 slots in file order in ")
    assert slab.slotted() == {(0, e) for e in range(4)}
