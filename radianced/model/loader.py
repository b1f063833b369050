"""Open a `.rad` and build its family's model over zero-copy weight views."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radianced.kernels.compact import CompactWeight
from radianced.kernels.formats import FORMATS, is_compact
from radianced.model.config import ModelConfig
from radianced.model.experts import ExpertSource, ResidentExperts
from radianced.model.layers import CausalLM, Weights
from radianced.model.llama import build_llama
from radianced.model.qwen3_moe import build_qwen3_moe
from radianced.model.qwen3_next import build_qwen3_next
from radianced.model.rad_format import RadError

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


def activation_dtype(rad: RadFile) -> torch.dtype:
    """The dtype a `.rad`'s model computes in (and its KV cache holds): its embeddings', or its final
    norm's when the embeddings are compact (`CausalLM` gathers compact rows into that dtype)."""
    embed = rad.tensor("model.embed_tokens.weight", verify=False)
    return embed.dtype if isinstance(embed, torch.Tensor) else rad.tensor("model.norm.weight", verify=False).dtype


def load_model(rad: RadFile, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
               experts: ExpertSource | None = None) -> CausalLM:
    """The model of a `.rad`; every tensor checksum-verified as it is loaded, cast to `dtype` if given.

    A MoE model without an `experts` source gets every expert resident. Compact tensors
    stay compact (`CompactWeight`: `dtype` does not apply to them) and run on the CPU
    only: the reference ops dequantize them per use, the host backend reads the int4
    packing made here (`CompactWeight.packed_for_cpu`), and a compact lm_head is made dense here
    (`_UNPACKED` says why); the Triton kernels do not read them yet.
    """
    compact = [t.name for t in rad.header.tensors if FORMATS[t.dtype].compact]
    compact += [f"experts of layer {e.layer}" for e in rad.header.experts[:1] if is_compact(e.dtype)]
    if compact and torch.device(device).type != "cpu":
        raise RadError(f"{rad.path}: {compact[0]} is stored compact ({len(compact)} such), which runs on the CPU "
                       f"only for now; convert the model without --compact / --quantize to serve it on {device}")

    def weights(name: str) -> torch.Tensor | CompactWeight:
        t = rad.tensor(name, verify=True)
        if isinstance(t, CompactWeight):
            t = t.to(device)
            return t if name in _UNPACKED else t.packed_for_cpu()  # the host backend's int4 form, made once
        return t.to(device=device, dtype=dtype or t.dtype)

    if experts is None and rad.header.experts:
        experts = ResidentExperts.from_rad(rad, device, dtype)
    model = build_model(rad.model, weights, experts)
    head = model.lm_head
    if isinstance(head.weight, CompactWeight) and head.weight.device.type == "cpu":
        head.weight = head.weight.dequantize(model.norm.weight.dtype)  # why: _UNPACKED
    return model


# Compact matrices the loader does not pack for the CPU's int4 kernel: the embedding table is only
# gathered by rows, and a compact lm_head is dequantized once at load to the activations' dtype and
# kept dense: the kernel rounds its output to bf16, which moves SmolLM2's logits by up to 2^-9 of
# their size (~0.05 at a logit of 20) and flipped near ties: with a packed lm_head the greedy answer
# to "What is the capital of France?" left transformers' at its first token; with the dense fp32
# head 3 prompts x 24 tokens matched it (the int4 layers alone move the logits 1-3% of max |logit|,
# without changing an argmax there). Cost: SmolLM2's head reads 113 MB a token in fp32 instead of
# 30 MB (4.4 ms against 1.8 ms a token on 2 threads).
_UNPACKED = frozenset({"model.embed_tokens.weight", "lm_head.weight"})
