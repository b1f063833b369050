"""Open a `.rad` and build its family's model over zero-copy weight views."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radianced.model.config import ModelConfig

if TYPE_CHECKING:
    from radianced.model.rad import RadFile


def build_model(cfg: ModelConfig, weights, **kwargs):
    """The family's model class over a `Weights` getter (name -> tensor)."""
    if cfg.family == "llama":
        from radianced.model.llama import LlamaModel
        return LlamaModel(cfg, weights, **kwargs)
    raise ValueError(f"family {cfg.family!r} has no model yet")


def load_model(rad: "RadFile", device: torch.device | str = "cpu", dtype: torch.dtype | None = None, **kwargs):
    """Every non-expert tensor checksum-verified as it is loaded, cast to `dtype` if given."""

    def weights(name: str) -> torch.Tensor:
        t = rad.tensor(name, verify=True)
        return t.to(device=device, dtype=dtype or t.dtype)

    return build_model(rad.model, weights, **kwargs)
