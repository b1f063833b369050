"""Llama (and SmolLM2): pre-norm decoder, GQA attention with RoPE, SiLU-gated MLP."""

from __future__ import annotations

from radianced.kv.cache import KVCache
from radianced.model.batch import ForwardBatch
from radianced.model.config import ModelConfig
from radianced.model.layers import Attention, CausalLM, DenseMLP, RMSNorm, Weights


class LlamaLayer:
    def __init__(self, cfg: ModelConfig, i: int, w: Weights):
        p = f"model.layers.{i}."
        self.input_norm = RMSNorm(w(p + "input_layernorm.weight"), cfg.rms_norm_eps)
        self.attn = Attention(cfg, i, w)
        self.post_norm = RMSNorm(w(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps)
        self.mlp = DenseMLP(p + "mlp", w)

    def __call__(self, x, rope, batch: ForwardBatch, cache: KVCache):
        x = self.attn(x, rope, batch, cache, residual=x, norm=self.input_norm)
        return self.mlp(x, residual=x, norm=self.post_norm)


def build_llama(cfg: ModelConfig, w: Weights) -> CausalLM:
    return CausalLM(cfg, w, [LlamaLayer(cfg, i, w) for i in range(cfg.num_hidden_layers)])
