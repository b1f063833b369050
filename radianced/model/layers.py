"""The building blocks every family is assembled from.

Blocks hold their weights as tensors fetched by name from a `Weights` getter
(the `.rad` file, zero-copy) and call ops through `radianced.kernels.ops`, the
one switch between Triton kernels and the torch reference. A matrix stored in a
compact format arrives as a `CompactWeight` and stays one: the reference ops
dequantize it per use, the host backend's block kernels read its bytes, and on CUDA the
linear kernels dequantize it in registers (kernels/linear.py), so every projection
goes through `ops.linear` / `ops.silu_mlp`, never F.linear on a dense copy.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from radianced.kernels import ops
from radianced.kernels.compact import CompactWeight, cat_rows
from radianced.kv.cache import KVCache
from radianced.model.batch import ForwardBatch
from radianced.model.config import ModelConfig
from radianced.model.experts import ExpertSource
from radianced.model.parallel import SINGLE, Group
from radianced.sharding import split_range

Weights = Callable[[str], torch.Tensor]


def row_parallel(group: Group, x: torch.Tensor, w, residual: torch.Tensor | None) -> torch.Tensor:
    """`x @ w.T (+ residual)` of a row-parallel projection: each rank's partial product summed over
    the group, then the residual added once. One rank keeps the residual in the projection's
    epilogue (o_proj's launch on CUDA)."""
    if group.size == 1:
        return ops.linear(x, w, residual=residual)
    out = group.all_reduce(ops.linear(x, w))
    return out if residual is None else residual + out


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float, zero_centred: bool = False):
        self.weight, self.eps, self.zero_centred = weight, eps, zero_centred

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, self.zero_centred)

    @property
    def params(self) -> tuple[torch.Tensor, float, bool]:
        """(weight, eps, zero_centred): the `norm` a projection applies in its own launch."""
        return self.weight, self.eps, self.zero_centred


class Rotary:
    """RoPE over the first `rotary_dim` dims of each head (all of them unless partial)."""

    def __init__(self, rotary_dim: int, theta: float):
        self.rotary_dim, self.theta = rotary_dim, theta
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope` for a step: (positions [T], inv_freq [rotary_dim / 2] fp32 on their device, made
        once per device); the rotary op takes its angles from them."""
        inv_freq = self._inv_freq.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq[positions.device] = ops.rotary_inv_freq(
                self.rotary_dim, self.theta, positions.device)
        return positions, inv_freq


class Attention:
    """Paged causal attention with GQA.

    Options cover the families: `qk_norm` (Qwen3: RMSNorm per head on q and k
    before RoPE), `output_gate` (Qwen3-Next: q_proj emits [query | gate] per head
    and the output is multiplied by sigmoid(gate)), `zero_centred` qk norms.
    """

    def __init__(self, cfg: ModelConfig, layer: int, w: Weights, *, qk_norm: bool = False,
                 output_gate: bool = False, zero_centred: bool = False, group: Group = SINGLE):
        """cfg: the card's (its query and KV heads; `sharding.card_config`); group: the ranks whose
        partial o_proj outputs are summed."""
        p = f"model.layers.{layer}.self_attn."
        self.layer, self.group = layer, group
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # q, k and v in one matmul: [q | k | v] rows, split after (one launch, one weight stream)
        projections = ("q_proj", "k_proj", "v_proj")
        self.wqkv = cat_rows([w(p + n + ".weight") for n in projections])
        self.bqkv = torch.cat([w(p + n + ".bias") for n in projections]) if cfg.attention_bias else None
        # [q | k | v] of the projection's output in heads of head_dim (q's with their gates)
        self.split = (self.wqkv.shape[0] // self.head_dim - 2 * self.kv_heads, self.kv_heads, self.kv_heads)
        self.wo = w(p + "o_proj.weight")
        self.q_norm = self.k_norm = None
        if qk_norm:
            self.q_norm = RMSNorm(w(p + "q_norm.weight"), cfg.rms_norm_eps, zero_centred)
            self.k_norm = RMSNorm(w(p + "k_norm.weight"), cfg.rms_norm_eps, zero_centred)
        self.output_gate = output_gate
        self.scale = self.head_dim ** -0.5

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
                 cache: KVCache, residual: torch.Tensor | None = None, norm: RMSNorm | None = None) -> torch.Tensor:
        """x: [T, hidden] -> the attention output [T, hidden], plus `residual` ([T, hidden]) if given
        (added in o_proj's epilogue on CUDA); `norm` (the layer's input norm) is applied to x first,
        in the q/k/v projection's launch where the kernel allows."""
        t = x.shape[0]
        qkv = ops.linear(x, self.wqkv, self.bqkv, norm=None if norm is None else norm.params)
        # views of one [T, q+2kv]: [T, heads, head_dim] each (two ops: each is a few us of a ~1 ms layer on the CPU)
        q, k, v = qkv.view(t, sum(self.split), self.head_dim).split_with_sizes(self.split, dim=1)
        gate = None
        if self.output_gate:
            q, gate = q.reshape(t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)  # [T, Hq, D] each
            gate = gate.reshape(t, self.heads * self.head_dim)
        positions, inv_freq = rope
        norms = {} if self.q_norm is None else dict(q_weight=self.q_norm.weight, k_weight=self.k_norm.weight,
                                                     eps=self.q_norm.eps, zero_centred=self.q_norm.zero_centred)
        k_cache, v_cache = cache.layer(self.layer)
        # qk-norm, RoPE, k and v into the cache, attention: on CUDA one launch (+ the split merge) at
        # decode, else two
        o = ops.rotary_paged_attention(q, k, v, positions, inv_freq, k_cache, v_cache, batch.slot_mapping,
                                       batch.block_tables, batch.query_start_t, batch.seq_lens_t, self.scale,
                                       decode=batch.is_decode, **norms).reshape(t, self.heads * self.head_dim)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return row_parallel(self.group, o, self.wo, residual)


class DenseMLP:
    """SiLU-gated MLP: `down(silu(gate(x)) * up(x))`; over a group, each rank's columns' partial sum
    is summed over the ranks (the shared expert is built without one: its MoE sums it with the
    routed experts' partial output, one all-reduce for both)."""

    def __init__(self, prefix: str, w: Weights, group: Group = SINGLE):
        self.gate, self.up, self.down = (w(f"{prefix}.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj"))
        self.group = group

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 norm: RMSNorm | None = None) -> torch.Tensor:
        """The MLP of `norm(x)` (x without a norm), plus `residual` when given."""
        if norm is not None:
            x = norm(x)
        out = self.group.all_reduce(ops.silu_mlp(x, self.gate, self.up, self.down))
        return out if residual is None else residual + out


class Embedding:
    def __init__(self, weight: torch.Tensor | CompactWeight, dtype: torch.dtype, group: Group = SINGLE,
                 vocab_size: int = 0):
        """weight: [V, hidden], on the compute device or, with `--embedding-placement ram` on a GPU,
        pinned in host RAM (model/loader.py); dtype: the activations' dtype, what a compact table's rows become.
        Over a group, weight is this rank's rows of a `vocab_size` table (`sharding.split_range`)."""
        self.weight, self.dtype, self.group = weight, dtype, group
        self.rows = split_range(vocab_size, group.rank, group.size) if group.size > 1 else None

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """[T] ids -> [T, hidden]. Vocab-parallel: each rank looks up the ids in its rows and zeroes
        the others, and one all-reduce sums the ranks' [T, hidden]."""
        if self.rows is None:
            return self._lookup(ids)
        first, stop = self.rows
        outside = (ids < first) | (ids >= stop)
        x = self._lookup(torch.where(outside, 0, ids - first)).masked_fill(outside[:, None], 0)
        return self.group.all_reduce(x)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, CompactWeight):
            return self.weight.rows(ids, self.dtype)  # only the looked-up rows are dequantized
        if self.weight.device != ids.device:  # the table in host RAM: the step's rows cross the link
            return ops.gather_rows(self.weight, ids)
        return F.embedding(ids, self.weight)


class LMHead:
    def __init__(self, weight: torch.Tensor, group: Group = SINGLE, vocab_size: int = 0):
        self.weight = weight  # [V, hidden]; over a group, this rank's rows of the vocab_size
        self.group, self.vocab_size = group, vocab_size

    def __call__(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """fp32 logits [T, V] of `norm(x)` (the model's final norm: in the projection's launch at
        T == 1 on CUDA, as the values `F.linear(norm(x), W).float()` gives); over a group, each
        rank's [T, V / N] gathered."""
        return self.group.all_gather(ops.linear(x, self.weight, norm=norm.params, out_dtype=torch.float32),
                                     self.vocab_size)


class Router:
    """The router's projection; the experts' op routes on its logits: softmax over all experts in
    fp32, top-k, optional renormalization of the k weights (`top_k`, `renormalize`)."""

    def __init__(self, weight: torch.Tensor, top_k: int, renormalize: bool):
        self.weight, self.top_k, self.renormalize = weight, top_k, renormalize  # weight: [E, hidden]

    def __call__(self, x: torch.Tensor, norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (logits [T, E] in x's dtype, the routed x: `norm(x)`, normed in the
        projection's launch where the kernel allows, or x without a norm)."""
        if norm is None:
            return ops.linear(x, self.weight), x
        return ops.linear(x, self.weight, norm=norm.params, keep_normed=True)


class MoE:
    """Routed experts read through the layer's expert table, plus an optional
    sigmoid-gated shared expert (Qwen3-Next).

    Over a group, expert-parallel: the router is whole on every rank, each rank runs the routed
    rows of its own experts (`split_range` of the ids; its source holds only those) and its
    columns of the shared expert, and one all-reduce sums the partial outputs. A rank's foreign
    assignments become its first expert at weight 0: the ids stay [T, k] (no host sync, the same
    ops and CUDA graphs), at the price of that expert's read when no token routed to it. Its
    source's `prepare` gets the routing before that (every expert id): a card's slab counts the
    assignments to its own experts, and reads in the first one too where the disk tier must.
    """

    def __init__(self, cfg: ModelConfig, layer: int, w: Weights, experts: ExpertSource, group: Group = SINGLE):
        p = f"model.layers.{layer}.mlp."
        self.layer, self.inter, self.experts, self.group = layer, cfg.moe_intermediate_size, experts, group
        self.owned = split_range(cfg.num_experts, group.rank, group.size)
        self.router = Router(w(p + "gate.weight"), cfg.num_experts_per_tok, cfg.norm_topk_prob)
        self.shared = self.shared_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared = DenseMLP(p + "shared_expert", w)  # its partial sum: reduced with the routed one
            self.shared_gate = w(p + "shared_expert_gate.weight")  # [1, hidden]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 norm: RMSNorm | None = None) -> torch.Tensor:
        """The experts' output for `norm(x)` (x without a norm; the router's launch normalizes),
        plus `residual` when given (added in the routed experts' last launch on one rank with no
        shared expert; after the shared expert's sum (and the group's) otherwise, the order the
        unfused `residual + (moe + shared)` rounds in)."""
        logits, x = self.router(x, norm)
        fused = residual if self.shared is None and self.group.size == 1 else None
        out = self._routed(x, logits, fused)
        if self.shared is not None:
            out = out + torch.sigmoid(ops.linear(x, self.shared_gate)) * self.shared(x)
        if fused is None:
            out = self.group.all_reduce(out)
            if residual is not None:
                out = residual + out
        return out

    def _routed(self, x: torch.Tensor, logits: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The routed experts (this rank's share of them over a group), plus `residual` if given.

        The routing goes to `experts.prepare`. A source that stages experts (`stages_experts`:
        a host sync) or holds a rank's share gets it from its own route launch, before the experts
        are read; any other only records the ids tensor, so the experts' op routes (in its gate/up
        launch at T == 1, kernels/moe.py) and prepare gets the ids it returns."""
        top_k, renormalize, experts = self.router.top_k, self.router.renormalize, self.experts
        fmt = experts.weight_format(self.layer)
        compact = {} if fmt is None else {"weight_format": fmt}  # the op reads the extents as bytes
        if experts.stages_experts or self.group.size > 1:
            ids, weights = ops.route(logits, top_k, renormalize, x.dtype)
            experts.prepare(self.layer, ids)  # the whole routing: a card's source counts (and stages) its own
            if self.group.size > 1:
                first, stop = self.owned
                foreign = (ids < first) | (ids >= stop)
                ids, weights = ids.masked_fill(foreign, first), weights.masked_fill(foreign, 0)
            return ops.moe(x, ids, weights, experts.table(self.layer), experts.slab, self.inter, experts.host,
                           residual=residual, staging=experts.staging, **compact)
        out, ids, _ = ops.route_moe(x, logits, top_k, renormalize, experts.table(self.layer), experts.slab,
                                    self.inter, experts.host, residual=residual, staging=experts.staging, **compact)
        experts.prepare(self.layer, ids)
        return out


class CausalLM:
    """Embedding -> decoder layers -> final norm -> lm_head, over one step's batch.

    Each layer is called as `layer(x, rope, batch, cache) -> x`; families differ
    only in the layers they build and in the final norm's kind.
    """

    def __init__(self, cfg: ModelConfig, w: Weights, layers: list, zero_centred: bool = False,
                 group: Group = SINGLE):
        """group: the ranks the model is split over (vocab-parallel embeddings and lm_head here)."""
        self.cfg = cfg
        final_norm = w("model.norm.weight")  # its dtype is the activations' (compact weights have none)
        self.embed = Embedding(w("model.embed_tokens.weight"), final_norm.dtype, group, cfg.vocab_size)
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)
        self.layers = layers
        self.norm = RMSNorm(final_norm, cfg.rms_norm_eps, zero_centred)
        self.lm_head = LMHead(self.embed.weight if cfg.tie_word_embeddings else w("lm_head.weight"), group,
                              cfg.vocab_size)
        self.mtp = None  # the MTP head where it drafts (model/mtp.py, Qwen3-Next)

    def forward(self, batch: ForwardBatch, cache: KVCache, hidden: bool = False):
        """Run the step; returns logits [R, V] (fp32) for batch.logits_rows, and with `hidden` also the
        final-normed hidden states [T, hidden] of every row (what the MTP head reads)."""
        x = self.embed(batch.input_ids)  # [T, hidden]
        rope = self.rotary.at(batch.positions)
        for layer in self.layers:
            x = layer(x, rope, batch, cache)
        logits = self.lm_head(x if batch.every_row else x[batch.logits_rows], self.norm)
        return (logits, self.norm(x)) if hidden else logits
