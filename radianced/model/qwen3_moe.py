"""Qwen3-MoE (Qwen3-30B-A3B): Llama's skeleton with per-head q/k RMSNorm and
routed SiLU experts (softmax router, top-k renormalized) reached through an
`ExpertSource`; layers in `mlp_only_layers` keep a dense MLP."""

from __future__ import annotations

from radianced.kv.cache import KVCache
from radianced.model.batch import ForwardBatch
from radianced.model.config import ModelConfig
from radianced.model.experts import ExpertSource
from radianced.model.layers import Attention, CausalLM, DenseMLP, MoE, RMSNorm, Weights
from radianced.model.parallel import SINGLE, Group


class Qwen3MoeLayer:
    def __init__(self, cfg: ModelConfig, i: int, w: Weights, experts: ExpertSource, group: Group = SINGLE):
        p = f"model.layers.{i}."
        self.input_norm = RMSNorm(w(p + "input_layernorm.weight"), cfg.rms_norm_eps)
        self.attn = Attention(cfg, i, w, qk_norm=True, group=group)
        self.post_norm = RMSNorm(w(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps)
        self.mlp = MoE(cfg, i, w, experts, group) if cfg.is_moe_layer(i) else DenseMLP(p + "mlp", w, group)

    def __call__(self, x, rope, batch: ForwardBatch, cache: KVCache):
        x = self.attn(x, rope, batch, cache, residual=x, norm=self.input_norm)
        return self.mlp(x, residual=x, norm=self.post_norm)


def build_qwen3_moe(cfg: ModelConfig, w: Weights, experts: ExpertSource, group: Group = SINGLE) -> CausalLM:
    return CausalLM(cfg, w, [Qwen3MoeLayer(cfg, i, w, experts, group) for i in range(cfg.num_hidden_layers)],
                    group=group)
