"""Open a `.rad` and build its family's model over zero-copy weight views."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radianced.model.config import ModelConfig
from radianced.model.experts import ExpertSource, ResidentExperts
from radianced.model.layers import CausalLM, Weights
from radianced.model.llama import build_llama
from radianced.model.qwen3_moe import build_qwen3_moe
from radianced.model.qwen3_next import build_qwen3_next

if TYPE_CHECKING:
    from radianced.model.rad import RadFile


def build_model(cfg: ModelConfig, weights: Weights, experts: ExpertSource | None = None) -> CausalLM:
    """The family's model over a `Weights` getter (name -> tensor) and, for MoE families, an expert source."""
    if cfg.family == "llama":
        return build_llama(cfg, weights)
    if cfg.family == "qwen3_moe":
        return build_qwen3_moe(cfg, weights, experts)
    if cfg.family == "qwen3_next":
        return build_qwen3_next(cfg, weights, experts)
    raise ValueError(f"family {cfg.family!r} has no model")


def load_model(rad: RadFile, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
               experts: ExpertSource | None = None) -> CausalLM:
    """The model of a `.rad`; every tensor checksum-verified as it is loaded, cast to `dtype` if given.

    A MoE model without an `experts` source gets every expert resident.
    """

    def weights(name: str) -> torch.Tensor:
        t = rad.tensor(name, verify=True)
        return t.to(device=device, dtype=dtype or t.dtype)

    if experts is None and rad.header.experts:
        experts = ResidentExperts.from_rad(rad, device, dtype)
    return build_model(rad.model, weights, experts)
