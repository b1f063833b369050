"""The building blocks every family is assembled from.

Blocks hold their weights as tensors fetched by name from a `Weights` getter
(the `.rad` file, zero-copy) and call ops through `radianced.kernels.ops`, the
one switch between Triton kernels and the torch reference.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from radianced.kernels import ops
from radianced.model.batch import ForwardBatch, KVCache
from radianced.model.config import ModelConfig

Weights = Callable[[str], torch.Tensor]


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float, zero_centred: bool = False):
        self.weight, self.eps, self.zero_centred = weight, eps, zero_centred

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, self.zero_centred)


class Rotary:
    """RoPE over the first `rotary_dim` dims of each head (all of them unless partial)."""

    def __init__(self, rotary_dim: int, theta: float):
        self.rotary_dim, self.theta = rotary_dim, theta

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.rotary_cos_sin(positions, self.rotary_dim, self.theta)


class Attention:
    """Paged causal attention with GQA.

    Options cover the families: `qk_norm` (Qwen3: RMSNorm per head on q and k
    before RoPE), `output_gate` (Qwen3-Next: q_proj emits [query | gate] per head
    and the output is multiplied by sigmoid(gate)), `zero_centred` qk norms.
    """

    def __init__(self, cfg: ModelConfig, layer: int, w: Weights, *, qk_norm: bool = False,
                 output_gate: bool = False, zero_centred: bool = False):
        p = f"model.layers.{layer}.self_attn."
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.wq, self.wk, self.wv, self.wo = (w(p + n + ".weight") for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        self.bq = self.bk = self.bv = None
        if cfg.attention_bias:
            self.bq, self.bk, self.bv = (w(p + n + ".bias") for n in ("q_proj", "k_proj", "v_proj"))
        self.q_norm = self.k_norm = None
        if qk_norm:
            self.q_norm = RMSNorm(w(p + "q_norm.weight"), cfg.rms_norm_eps, zero_centred)
            self.k_norm = RMSNorm(w(p + "k_norm.weight"), cfg.rms_norm_eps, zero_centred)
        self.output_gate = output_gate
        self.scale = self.head_dim ** -0.5

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
                 cache: KVCache) -> torch.Tensor:
        t = x.shape[0]  # x: [T, hidden]
        q = F.linear(x, self.wq, self.bq)
        gate = None
        if self.output_gate:
            q, gate = q.view(t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)  # [T, Hq, D] each
            gate = gate.reshape(t, self.heads * self.head_dim)
        q = q.reshape(t, self.heads, self.head_dim)
        k = F.linear(x, self.wk, self.bk).view(t, self.kv_heads, self.head_dim)
        v = F.linear(x, self.wv, self.bv).view(t, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = ops.apply_rotary(q, cos, sin), ops.apply_rotary(k, cos, sin)
        k_cache, v_cache = cache.layer(self.layer)
        ops.write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
        o = ops.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.query_start, batch.seq_lens,
                                self.scale).reshape(t, self.heads * self.head_dim)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return F.linear(o, self.wo)


class DenseMLP:
    """SiLU-gated MLP: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, prefix: str, w: Weights):
        self.gate, self.up, self.down = (w(f"{prefix}.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj"))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_mlp(x, self.gate, self.up, self.down)


class Embedding:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # [V, hidden]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # [V, hidden]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight).float()
