"""Qwen3-Next's multi-token-prediction (MTP) layer: the drafter of `--speculative-method mtp`.

transformers does not implement it; this follows the model's published inference code (vLLM's
qwen3_next_mtp.py). With h_p the main model's final-normed hidden state at position p and t the
token at position p+1 (the next input, or the token sampled at p):

    x   = fc([norm_e(embed(t)) ; norm_h(h_p)])     fc: [H, 2H], the embedding's half first
    x   = one full-attention decoder layer at position p: gated attention with its own paged KV
          (one more layer of the attention paging group) and the MoE with its shared expert
    g_p = norm(x);   logits = lm_head(g_p)          the main model's embedding and lm_head

argmax(logits) drafts the token at p+2. Every norm is zero-centred (x * (1 + w)), as the main
model's. The layer runs over every position the main model computes (prefill chunks included),
so its KV is complete wherever a later position attends; the MTP layer's routed experts are the
`.rad`'s layer `num_hidden_layers` (model/hf_plan.py), resident on the card as the budget's "mtp"
class charges them.
"""

from __future__ import annotations

import msgspec
import torch

from radianced.kernels import ops
from radianced.kv.cache import KVCache
from radianced.model.batch import ForwardBatch
from radianced.model.config import ModelConfig
from radianced.model.layers import Embedding, LMHead, RMSNorm, Weights


class MTPHead:
    """The first MTP layer of a Qwen3-Next `.rad` (`num_mtp_layers` >= 1).

    layer: the family's full-attention decoder layer built as layer `num_hidden_layers` (its KV
    layer and expert table) over `mtp_layer_weights` (model/qwen3_next.py builds it)."""

    def __init__(self, cfg: ModelConfig, w: Weights, layer, embed: Embedding, lm_head: LMHead):
        eps = cfg.rms_norm_eps
        self.fc = w("mtp.fc.weight")  # [H, 2H]
        self.norm_embedding = RMSNorm(w("mtp.pre_fc_norm_embedding.weight"), eps, zero_centred=True)
        self.norm_hidden = RMSNorm(w("mtp.pre_fc_norm_hidden.weight"), eps, zero_centred=True)
        self.norm = RMSNorm(w("mtp.norm.weight"), eps, zero_centred=True)
        self.layer, self.embed, self.lm_head = layer, embed, lm_head

    def __call__(self, next_ids: torch.Tensor, hidden: torch.Tensor, rope, batch: ForwardBatch,
                 cache: KVCache) -> torch.Tensor:
        """next_ids [T]: the token after each row's; hidden [T, H]: the main model's final-normed
        states of the rows (batch's rows: its positions, block tables and KV slots). Writes the MTP
        layer's KV of every row; returns x [T, H] before the MTP norm (`logits` and `chained` apply it)."""
        e = self.norm_embedding(self.embed(next_ids))
        x = ops.linear(torch.cat((e, self.norm_hidden(hidden)), dim=-1), self.fc)
        return self.layer(x, rope, batch, cache)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 draft logits [R, V] of rows x [R, H] (as `__call__` returns them)."""
        return self.lm_head(x, self.norm)

    def chained(self, x: torch.Tensor) -> torch.Tensor:
        """The hidden state a chained draft step reads for rows x: g = norm(x)."""
        return self.norm(x)


def mtp_layer_config(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with the MTP layer as layer `num_hidden_layers`: full attention (and MoE, by the family's rule)."""
    return msgspec.structs.replace(cfg, layer_types=(*cfg.layer_types, "full_attention"))


def mtp_layer_weights(cfg: ModelConfig, w: Weights) -> Weights:
    """The MTP layer's weights under the names of layer `num_hidden_layers` (stored as `mtp.layers.0.*`)."""
    stored = f"model.layers.{cfg.num_hidden_layers}."
    return lambda name: w(name.replace(stored, "mtp.layers.0.", 1))
