"""Qwen3-Next (Qwen3-Next-80B-A3B): a hybrid of Gated DeltaNet linear attention
and gated full attention (3:1 by default, any pattern via `layer_types`), every
layer followed by routed experts plus a sigmoid-gated shared expert.

Norms are zero-centred (x * (1 + w)) except the DeltaNet output norm, which is
the ordinary kind, gated by silu(z). Full attention has per-head q/k norms,
partial RoPE and an output gate. The `mtp.*` weights are the MTP head's
(model/mtp.py), built when it drafts.
"""

from __future__ import annotations

import torch

from radianced.kernels import ops
from radianced.kv.cache import KVCache
from radianced.model.batch import ForwardBatch
from radianced.model.config import ModelConfig
from radianced.model.experts import ExpertSource
from radianced.model.layers import MoE, Attention, CausalLM, DenseMLP, RMSNorm, Weights, row_parallel
from radianced.model.mtp import MTPHead, mtp_layer_config, mtp_layer_weights
from radianced.model.parallel import SINGLE, Group


class GatedDeltaNet:
    """Linear attention with a delta-rule state per value head, one state slot per sequence.

    in_proj_qkvz is grouped per key head as [q | k | v (r heads) | z (r heads)] and
    in_proj_ba as [b (r) | a (r)], r = value heads per key head. q, k, v pass a
    depthwise causal conv1d + SiLU; beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias).
    """

    def __init__(self, cfg: ModelConfig, layer: int, w: Weights, group: Group = SINGLE):
        """cfg: the card's (its key and value heads); group: the ranks whose out_proj partials are summed."""
        p = f"model.layers.{layer}.linear_attn."
        self.layer, self.group = layer, group
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.r = self.nv // self.nk
        self.w_qkvz, self.w_ba = w(p + "in_proj_qkvz.weight"), w(p + "in_proj_ba.weight")
        self.conv_weight = w(p + "conv1d.weight").squeeze(1)  # [C, K]
        self.dt_bias, self.a_log = w(p + "dt_bias"), w(p + "A_log")
        self.norm_weight, self.eps = w(p + "norm.weight"), cfg.rms_norm_eps
        self.w_out = w(p + "out_proj.weight")

    def __call__(self, x, rope, batch: ForwardBatch, cache: KVCache, residual: torch.Tensor | None = None,
                 norm: RMSNorm | None = None):
        """x: [T, hidden] -> the mixer's output [T, hidden] for `norm(x)` (x without a norm), plus
        `residual` if given (as `Attention`)."""
        if norm is not None:
            x = norm(x)
        t = x.shape[0]
        qkvz = ops.linear(x, self.w_qkvz).view(t, self.nk, 2 * self.dk + 2 * self.r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, self.r * self.dv, self.r * self.dv], dim=-1)
        b, a = ops.linear(x, self.w_ba).view(t, self.nk, 2 * self.r).split([self.r, self.r], dim=-1)
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)  # [T, C]
        g, beta = ops.deltanet_gates(a.reshape(t, self.nv), b.reshape(t, self.nv), self.a_log, self.dt_bias)
        conv_states, rec_states = cache.states.layer(self.layer)
        if batch.is_decode:
            # decode: one token per sequence, all states updated in place by slot (no host sync, so a
            # CUDA graph can capture it); a slot < 0 is a graph's padding row: zero output, no state touched
            y = ops.causal_conv1d_update(mixed, self.conv_weight, conv_states, batch.state_slots)
            qs, ks, vs = y.split([self.nk * self.dk, self.nk * self.dk, self.nv * self.dv], dim=-1)
            out = ops.gated_delta_rule_decode(
                qs.view(t, self.nk, self.dk), ks.view(t, self.nk, self.dk), vs.view(t, self.nv, self.dv),
                g, beta, rec_states, batch.state_slots, use_qk_l2norm=True)
            return self._output(out, z, t, residual)
        if batch.all_decoding:  # a verify step in a mixed graph: the sequences on the device only
            return self._output(self._verify(mixed, g, beta, batch, cache.states), z, t, residual)
        if len(batch.state_slot_ids) != batch.num_seqs:
            raise ValueError("a hybrid step that is not decode-shaped needs its state slots on the host "
                             "(ForwardBatch.build's state_slots)")
        decoding = batch.decoding
        # a verify step's positions, or one token (a decode beside a prompt's chunk or beside drafting sequences):
        # decoding's arithmetic, all such sequences in one launch per op, so a sequence's state never depends on
        # what shares its step; their rows first, then each prompt chunk's rows through fla
        out = self._verify(mixed, g, beta, batch, cache.states) if any(decoding) else \
            torch.empty((t, self.nv, self.dv), dtype=x.dtype, device=x.device)
        for s, slot in enumerate(batch.state_slot_ids):  # the host's copy: no device read in each layer
            if decoding[s]:
                continue
            lo, hi = batch.query_start[s], batch.query_start[s + 1]
            y, conv_states[slot] = ops.causal_conv1d_prefill(mixed[lo:hi], self.conv_weight, conv_states[slot])
            qs, ks, vs = y.split([self.nk * self.dk, self.nk * self.dk, self.nv * self.dv], dim=-1)
            o, rec_states[slot] = ops.gated_delta_rule_chunked(
                qs.reshape(-1, self.nk, self.dk), ks.reshape(-1, self.nk, self.dk), vs.reshape(-1, self.nv, self.dv),
                g[lo:hi], beta[lo:hi], rec_states[slot], use_qk_l2norm=True)  # q, k: raw key heads
            out[lo:hi] = o
        return self._output(out, z, t, residual)

    def _verify(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, batch: ForwardBatch,
                states) -> torch.Tensor:
        """The step's sequences that run decoding's arithmetic (model/batch.py `runs_decoding`: a verify step's
        last token and drafts, or one token), each position after position, all in one launch per op
        (`*_verify`), so each position's state is the one plain decoding reaches and the state after each
        position but a sequence's last is left in its draft slots (the runner keeps the accepted one). The
        sequences and their slots are read on the device (`batch.verify_slots`: -1 for a prompt's chunk,
        whose rows of the result are left for the caller). Returns o: [T, Hv, V]."""
        conv_states, rec_states = states.layer(self.layer)
        t = mixed.shape[0]
        y = ops.causal_conv1d_verify(mixed, self.conv_weight, conv_states, batch.query_start_t, batch.verify_slots,
                                     states.num_seqs, states.drafts_per_seq)
        qs, ks, vs = y.split([self.nk * self.dk, self.nk * self.dk, self.nv * self.dv], dim=-1)
        return ops.gated_delta_rule_verify(qs.view(t, self.nk, self.dk), ks.view(t, self.nk, self.dk),
                                           vs.view(t, self.nv, self.dv), g, beta, rec_states, batch.query_start_t,
                                           batch.verify_slots, states.num_seqs, states.drafts_per_seq,
                                           use_qk_l2norm=True)

    def _output(self, out: torch.Tensor, z: torch.Tensor, t: int, residual: torch.Tensor | None) -> torch.Tensor:
        """out: [T, Hv, V] -> gated norm by silu(z) -> out_proj (+ residual): [T, hidden]."""
        o = ops.gated_rms_norm(out, z.reshape(t, self.nv, self.dv), self.norm_weight, self.eps)
        return row_parallel(self.group, o.reshape(t, self.nv * self.dv), self.w_out, residual)


class Qwen3NextLayer:
    def __init__(self, cfg: ModelConfig, i: int, w: Weights, experts: ExpertSource, group: Group = SINGLE):
        p, eps = f"model.layers.{i}.", cfg.rms_norm_eps
        self.input_norm = RMSNorm(w(p + "input_layernorm.weight"), eps, zero_centred=True)
        if cfg.layer_type(i) == "linear_attention":
            self.mixer = GatedDeltaNet(cfg, i, w, group)
        else:
            self.mixer = Attention(cfg, i, w, qk_norm=True, output_gate=True, zero_centred=True, group=group)
        self.post_norm = RMSNorm(w(p + "post_attention_layernorm.weight"), eps, zero_centred=True)
        self.mlp = MoE(cfg, i, w, experts, group) if cfg.is_moe_layer(i) else DenseMLP(p + "mlp", w, group)

    def __call__(self, x, rope, batch: ForwardBatch, cache: KVCache):
        x = self.mixer(x, rope, batch, cache, residual=x, norm=self.input_norm)
        return self.mlp(x, residual=x, norm=self.post_norm)


def build_qwen3_next(cfg: ModelConfig, w: Weights, experts: ExpertSource, mtp: bool = False,
                     mtp_experts: ExpertSource | None = None, group: Group = SINGLE) -> CausalLM:
    """mtp: also build the MTP head (`model.mtp`), its routed experts from `mtp_experts`; over a `group`,
    the rank's share of it, split as a decoder layer (model/sharded_loader.py)."""
    model = CausalLM(cfg, w, [Qwen3NextLayer(cfg, i, w, experts, group) for i in range(cfg.num_hidden_layers)],
                     zero_centred=True, group=group)
    if mtp:
        layer = Qwen3NextLayer(mtp_layer_config(cfg), cfg.num_hidden_layers, mtp_layer_weights(cfg, w), mtp_experts,
                               group)
        model.mtp = MTPHead(cfg, w, layer, model.embed, model.lm_head)
    return model
