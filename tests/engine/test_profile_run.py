"""`radiancectl profile`: prompts through a tiny MoE, exact routing counts in the profile,
and start-up filling the expert slots with exactly the top-ranked pairs."""

from __future__ import annotations

import logging
import shutil

from radianced import ctl
from radianced.card import Card
from radianced.config import Config
from radianced.engine.engine import Engine
from radianced.model.rad import RadFile
from radianced.model.tokenizer import Tokenizer
from radianced.tiers.placement import routed_experts
from radianced.tiers.profile import Profile, profile_path

PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):", "1 2 3 4 5 6 7"]
SLOTS = 6


def _own_copy(rad, tmp_path) -> RadFile:
    """A private copy of the tiny model: a profile beside the shared one would change other tests' builds."""
    dst = tmp_path / "m.rad"
    shutil.copyfile(rad.path, dst)
    return RadFile.open(dst)


def _slotted_build(rad) -> Engine:
    return Engine.build(rad, Config(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, host_pool_mib=1,
                                    expert_slots=SLOTS), Card.from_mib(256))


def test_profile_then_build_fills_slots_with_the_top_ranked_pairs(tiny_rads, tmp_path, caplog, capsys):
    rad = _own_copy(tiny_rads["qwen3_moe"], tmp_path)
    file = tmp_path / "prompts.txt"
    file.write_text("\n".join(PROMPTS[:2]) + "\n\n" + "\n".join(PROMPTS[2:]) + "\n")
    # one token each: the engine runs exactly the prompt tokens (the sampled token is never fed back)
    assert ctl.main(["profile", str(rad.path), "--prompts", str(file), "--max-tokens", "1"]) == 0
    path = profile_path(rad.path)
    assert capsys.readouterr().out.startswith(f"{path}: ")

    profile = Profile.load_for(rad)
    m = rad.model
    per_layer = [sum(profile.count(layer, e) for e in range(m.num_experts)) for layer in m.moe_layers]
    tokenizer = Tokenizer.from_header(rad.header)
    prompt_tokens = sum(len(tokenizer.encode(p, add_special_tokens=True)) for p in PROMPTS)
    # every prompt token routed k experts in every MoE layer
    assert per_layer == [prompt_tokens * m.num_experts_per_tok] * len(m.moe_layers)
    assert profile.steps == 1  # all four prompts prefilled in one step
    ranked = profile.ranked()
    assert [c for _, _, c in ranked] == sorted((c for _, _, c in ranked), reverse=True)

    caplog.set_level(logging.INFO, logger="radianced.engine")
    engine = _slotted_build(rad)
    assert engine.experts.num_slots == SLOTS
    top = frozenset(profile.rank()[:SLOTS])
    assert top != frozenset(routed_experts(rad.header)[:SLOTS])  # the profile, not the file order, decided
    assert engine.experts.slotted() == top
    assert f"profile m.rad.expert-profile.bin: {len(profile)} ranked pairs" in caplog.messages


def test_a_profile_of_another_model_is_ignored_with_a_warning(tiny_rads, tmp_path, caplog):
    rad = _own_copy(tiny_rads["qwen3_moe"], tmp_path)
    m = rad.model
    stale = Profile(12345, m.moe_layers, m.num_experts, {(m.moe_layers[-1], m.num_experts - 1): 99})
    stale.save(profile_path(rad.path))
    caplog.set_level(logging.INFO, logger="radianced.engine")
    engine = _slotted_build(rad)
    assert engine.experts.slotted() == frozenset(routed_experts(rad.header)[:SLOTS])  # file order
    assert any("made for another model file" in msg and "file order" in msg for msg in caplog.messages)
