"""What llama.cpp's converter (`Qwen3NextModel` in convert_hf_to_gguf.py) changes in a Qwen3-Next, undone.

A `qwen3next` GGUF stores the Hugging Face tensors under llama.cpp's names, with
these changes, each reversed here so the `.rad` holds the checkpoint's tensors:

- `in_proj_qkvz` [per key head: q | k | v | z] is split into `attn_qkv` (all q
  heads, all k heads, all v heads) and `attn_gate` (all z): `join_qkvz` puts the
  rows back. It only moves whole rows, so it works on compact bytes as well.
- every zero-centred RMSNorm weight (input, post-attention, q / k norms, the
  final norm; not the DeltaNet output norm) is stored as `1 + w`: `restore`
  subtracts 1. That subtraction is exact (Sterbenz, `1 + w` in [0.5, 2]) but cannot
  bring back the low bits of w that `1 + w` rounded off; what the model uses, its
  own `1 + w`, is then the stored value bit for bit, the value transformers computes;
- `A_log` is stored as `ssm_a = -exp(A_log)`: `restore` takes `log(-ssm_a)` (the
  model's `-exp(A_log)` then equals `ssm_a` to within an fp32 rounding);
- `dt_bias` is `ssm_dt.bias`, `conv1d.weight` [C, 1, W] is squeezed to [C, W], and the
  shared expert's gate [1, H] may be stored as [H];
- MTP layers are not written to the GGUF (`num_mtp_layers` is 0).
"""

from __future__ import annotations

import torch

from radianced.kernels.compact import CompactWeight
from radianced.model.config import ModelConfig

NAMES = {  # ggml block tensor -> its name under model.layers.N.
    "attn_norm": "input_layernorm.weight", "post_attention_norm": "post_attention_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight", "attn_k": "self_attn.k_proj.weight", "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight", "attn_q_norm": "self_attn.q_norm.weight",
    "attn_k_norm": "self_attn.k_norm.weight", "attn_qkv": "linear_attn.in_proj_qkvz.weight",
    "attn_gate": "linear_attn.in_proj_qkvz.weight", "ssm_ba": "linear_attn.in_proj_ba.weight",
    "ssm_conv1d": "linear_attn.conv1d.weight", "ssm_dt": "linear_attn.dt_bias", "ssm_a": "linear_attn.A_log",
    "ssm_norm": "linear_attn.norm.weight", "ssm_out": "linear_attn.out_proj.weight", "ffn_gate_inp": "mlp.gate.weight",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj.weight", "ffn_up_shexp": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp": "mlp.shared_expert.down_proj.weight", "ffn_gate_inp_shexp": "mlp.shared_expert_gate.weight",
}
_KINDS = {"ssm_dt": "bias", "ssm_a": None}  # the suffix llama.cpp gives a tensor (default "weight")
_SHIFTED = {"attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm", "output_norm"}  # stored as 1 + w


def hf_name(layer: str, part: str, kind: str | None) -> str | None:
    """The checkpoint name of block tensor `blk.{layer}.{part}[.{kind}]`; None if it has no place."""
    if part not in NAMES or kind != _KINDS.get(part, "weight"):
        return None
    return f"model.layers.{layer}.{NAMES[part]}"


def restore(part: str, x: torch.Tensor | CompactWeight, cfg: ModelConfig) -> torch.Tensor | CompactWeight:
    """The checkpoint's value of a GGUF tensor `part` (see the module docstring); others as they are."""
    if part in _SHIFTED:
        return x - 1
    if part == "ssm_a":
        return torch.log(-x)
    if part == "ssm_conv1d":
        return x.reshape(x.shape[0], 1, -1)
    if part == "ffn_gate_inp_shexp":
        return x.reshape(1, cfg.hidden_size)
    return x


def join_qkvz(qkv: torch.Tensor | CompactWeight, gate: torch.Tensor | CompactWeight,
              cfg: ModelConfig) -> torch.Tensor | CompactWeight:
    """`in_proj_qkvz` [per key head: q (dk) | k (dk) | v (r * dv) | z (r * dv) rows] from llama.cpp's
    `attn_qkv` [q heads | k heads | v heads] and `attn_gate` [z heads]; both dense or both compact of one format."""
    nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    vz = cfg.linear_num_value_heads // nk * cfg.linear_value_head_dim  # v (and z) rows per key head
    compact = isinstance(qkv, CompactWeight)
    a = qkv.data.reshape(qkv.shape[0], -1) if compact else qkv
    z = gate.data.reshape(gate.shape[0], -1) if compact else gate
    width = a.shape[1]
    q, k, v = a.split([nk * dk, nk * dk, a.shape[0] - 2 * nk * dk])
    rows = torch.cat([q.reshape(nk, dk, width), k.reshape(nk, dk, width), v.reshape(nk, vz, width),
                      z.reshape(nk, vz, width)], dim=1).reshape(-1, width)
    if compact:
        return CompactWeight(qkv.fmt, (rows.shape[0], qkv.shape[1]), rows.contiguous())
    return rows.contiguous()


def config_fields(meta: dict, p: str, head_dim: int, layers: int) -> dict:
    """The qwen3_next `ModelConfig` fields of a qwen3next GGUF's metadata (prefix `p`)."""
    value_heads = meta[p + "ssm.time_step_rank"]
    interval = meta.get(p + "full_attention_interval", 4)
    return dict(
        linear_conv_kernel_dim=meta[p + "ssm.conv_kernel"], linear_key_head_dim=meta[p + "ssm.state_size"],
        linear_num_key_heads=meta[p + "ssm.group_count"], linear_num_value_heads=value_heads,
        linear_value_head_dim=meta[p + "ssm.inner_size"] // value_heads,
        shared_expert_intermediate_size=meta.get(p + "expert_shared_feed_forward_length", 0),
        partial_rotary_factor=meta.get(p + "rope.dimension_count", head_dim) / head_dim,
        layer_types=tuple("linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)),
    )
