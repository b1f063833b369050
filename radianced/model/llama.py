"""Llama (and SmolLM2): pre-norm decoder, GQA attention with RoPE, SiLU-gated MLP."""

from __future__ import annotations

import torch

from radianced.model.batch import ForwardBatch, KVCache
from radianced.model.config import ModelConfig
from radianced.model.layers import Attention, DenseMLP, Embedding, LMHead, RMSNorm, Rotary, Weights


class LlamaLayer:
    def __init__(self, cfg: ModelConfig, i: int, w: Weights):
        p = f"model.layers.{i}."
        self.input_norm = RMSNorm(w(p + "input_layernorm.weight"), cfg.rms_norm_eps)
        self.attn = Attention(cfg, i, w)
        self.post_norm = RMSNorm(w(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps)
        self.mlp = DenseMLP(p + "mlp", w)

    def __call__(self, x, rope, batch: ForwardBatch, cache: KVCache):
        x = x + self.attn(self.input_norm(x), rope, batch, cache)
        return x + self.mlp(self.post_norm(x))


class LlamaModel:
    def __init__(self, cfg: ModelConfig, w: Weights):
        self.cfg = cfg
        self.embed = Embedding(w("model.embed_tokens.weight"))
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)
        self.layers = [LlamaLayer(cfg, i, w) for i in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(w("model.norm.weight"), cfg.rms_norm_eps)
        self.lm_head = LMHead(self.embed.weight if cfg.tie_word_embeddings else w("lm_head.weight"))

    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Run the step; returns logits [R, V] (fp32) for batch.logits_rows."""
        x = self.embed(batch.input_ids)  # [T, hidden]
        rope = self.rotary.cos_sin(batch.positions)
        for layer in self.layers:
            x = layer(x, rope, batch, cache)
        return self.lm_head(self.norm(x[batch.logits_rows]))
