"""Llama (and SmolLM2): pre-norm decoder, GQA attention with RoPE, SiLU-gated MLP."""

from __future__ import annotations

from radianced.kernels import ops
from radianced.kv.cache import KVCache
from radianced.model.batch import ForwardBatch
from radianced.model.config import ModelConfig
from radianced.model.layers import Attention, CausalLM, DenseMLP, RMSNorm, Weights
from radianced.model.parallel import SINGLE, Group


class LlamaLayer:
    def __init__(self, cfg: ModelConfig, i: int, w: Weights, group: Group = SINGLE):
        p = f"model.layers.{i}."
        self.input_norm = RMSNorm(w(p + "input_layernorm.weight"), cfg.rms_norm_eps)
        self.attn = Attention(cfg, i, w, group=group)
        self.post_norm = RMSNorm(w(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps)
        self.mlp = DenseMLP(p + "mlp", w, group)

    def __call__(self, x, rope, batch: ForwardBatch, cache: KVCache):
        fused = ops.dense_layer(self, x, rope, batch, cache)  # the host backend's decode layer in one call
        if fused is not None:
            return fused
        x = self.attn(x, rope, batch, cache, residual=x, norm=self.input_norm)
        return self.mlp(x, residual=x, norm=self.post_norm)


def build_llama(cfg: ModelConfig, w: Weights, group: Group = SINGLE) -> CausalLM:
    return CausalLM(cfg, w, [LlamaLayer(cfg, i, w, group) for i in range(cfg.num_hidden_layers)], group=group)
