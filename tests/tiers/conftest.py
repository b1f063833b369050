"""A real `.rad` for the tier tests, built once per session.

`tier_rad` is a tiny Qwen3-MoE (3 MoE layers x 16 experts) from `make_tiny`,
converted with bf16 weights so that an expert extent (3 x 24 x 64 x 2 = 9216
bytes) is not a multiple of 4096: O_DIRECT reads then carry padding, and every
extent after the first starts on a 4096 boundary past the previous one's end.
`expert_bytes(rad, layer, expert)` is what `RadFile.expert` gives, as bytes.
"""

from __future__ import annotations

import pytest
import torch

from radianced.model.convert import convert
from radianced.model.rad import RadFile
from radianced.model.tiny import make_tiny

LAYERS, EXPERTS, INTER, HIDDEN = 3, 16, 24, 64
EXTENT = 3 * INTER * HIDDEN * 2  # bf16


@pytest.fixture(scope="session")
def tier_rad(tmp_path_factory):
    """Path of the tiny MoE `.rad` (read-only: tests that damage it work on a copy)."""
    root = tmp_path_factory.mktemp("tier_model")
    src = make_tiny("qwen3_moe", root / "hf", num_experts=EXPERTS, moe_intermediate_size=INTER)
    dst = root / "m.rad"
    convert(src, dst, dtype="bf16")
    with RadFile.open(dst) as rad:
        assert rad.model.moe_layers == tuple(range(LAYERS)) and rad.model.num_experts == EXPERTS
        assert {e.nbytes for e in rad.header.experts} == {EXTENT}
    return dst


def _expert_bytes(rad: RadFile, layer: int, expert: int) -> bytes:
    gate, up, down = rad.expert(layer, expert, verify=True)
    return b"".join(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in (gate, up, down))


@pytest.fixture(scope="session")
def expert_bytes():
    return _expert_bytes
