"""What a Hugging Face checkpoint's `.rad` will hold, in write order, checked against config.json.

Names in the `.rad` are the Hugging Face checkpoint names
(`model.layers.0.self_attn.q_proj.weight`, ...). Routed experts are never plain
tensors: each (layer, expert) becomes one `RadWriter.add_expert` extent, from
either checkpoint layout (per-expert `mlp.experts.E.{gate,up,down}_proj.weight`,
or transformers-5 fused `mlp.experts.gate_up_proj` [E, 2I, H] + `down_proj`
[E, H, I]). Qwen3-Next `mtp.*` weights are kept as plain tensors under their
names, except the MTP layers' routed experts: MTP layer j's experts are extents
at layer `num_hidden_layers + j`, so the expert tiers can serve them like any
other layer. `num_mtp_layers` in the stored config counts the MTP layers
actually present in the checkpoint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

from radianced.model.config import ModelConfig
from radianced.model.convert import ConvertError
from radianced.model.hf_source import Shards, SourceTensor

_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # a buffer some old checkpoints saved
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


@dataclass(frozen=True)
class PlainTensor:
    """A tensor copied as it is (cast if asked).

    name: its name, in the checkpoint and in the `.rad`.
    shape: its shape, as config.json implies.
    """

    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ExpertPieces:
    """One routed expert, written as one extent from three checkpoint pieces.

    layer: the `.rad` layer index (MTP layer j -> num_hidden_layers + j).
    expert: its index in the layer.
    prefix: the checkpoint names' common start, e.g. "model.layers.3.mlp.experts.".
    fused: the checkpoint holds gate_up_proj [E, 2I, H] + down_proj [E, H, I]; else
        per-expert `{prefix}{expert}.{gate,up,down}_proj.weight`.
    inter: the expert's intermediate size I.
    """

    layer: int
    expert: int
    prefix: str
    fused: bool
    inter: int


def expected_layer(cfg: ModelConfig, p: str, layer_type: str, moe: bool) -> list[tuple[str, tuple[int, ...]]]:
    """Non-expert tensors of one decoder layer with name prefix `p`, and their shapes."""
    H, d = cfg.hidden_size, cfg.head_dim
    out = [(f"{p}input_layernorm.weight", (H,)), (f"{p}post_attention_layernorm.weight", (H,))]
    if layer_type == "linear_attention":  # Gated DeltaNet
        key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        nv = cfg.linear_num_value_heads
        a = f"{p}linear_attn."
        out += [(f"{a}in_proj_qkvz.weight", (2 * key_dim + 2 * value_dim, H)),
                (f"{a}in_proj_ba.weight", (2 * nv, H)),
                (f"{a}conv1d.weight", (2 * key_dim + value_dim, 1, cfg.linear_conv_kernel_dim)),
                (f"{a}dt_bias", (nv,)), (f"{a}A_log", (nv,)),
                (f"{a}norm.weight", (cfg.linear_value_head_dim,)),
                (f"{a}out_proj.weight", (H, value_dim))]
    else:
        q_rows = cfg.num_attention_heads * d * (2 if cfg.family == "qwen3_next" else 1)  # next: query + gate
        kv_rows = cfg.num_key_value_heads * d
        a = f"{p}self_attn."
        out += [(f"{a}q_proj.weight", (q_rows, H)), (f"{a}k_proj.weight", (kv_rows, H)),
                (f"{a}v_proj.weight", (kv_rows, H)), (f"{a}o_proj.weight", (H, cfg.num_attention_heads * d))]
        if cfg.attention_bias:
            out += [(f"{a}q_proj.bias", (q_rows,)), (f"{a}k_proj.bias", (kv_rows,)),
                    (f"{a}v_proj.bias", (kv_rows,)), (f"{a}o_proj.bias", (H,))]
        if cfg.family != "llama":
            out += [(f"{a}q_norm.weight", (d,)), (f"{a}k_norm.weight", (d,))]
    m = f"{p}mlp."
    if moe:
        out.append((f"{m}gate.weight", (cfg.num_experts, H)))
        if cfg.shared_expert_intermediate_size:
            si = cfg.shared_expert_intermediate_size
            out += [(f"{m}shared_expert.gate_proj.weight", (si, H)), (f"{m}shared_expert.up_proj.weight", (si, H)),
                    (f"{m}shared_expert.down_proj.weight", (H, si)), (f"{m}shared_expert_gate.weight", (1, H))]
    else:
        inter = cfg.intermediate_size
        out += [(f"{m}gate_proj.weight", (inter, H)), (f"{m}up_proj.weight", (inter, H)),
                (f"{m}down_proj.weight", (H, inter))]
    return out


def plan_hf(cfg: ModelConfig, shards: Shards) -> tuple[ModelConfig, list[PlainTensor | ExpertPieces]]:
    """Every output in write order, checked against the source's names and shapes.

    Returns the config to store (num_mtp_layers set to the MTP layers present).
    Raises ConvertError naming the first missing, misshapen or unexpected tensor.
    """
    src = shards.tensors
    H = cfg.hidden_size
    plan: list[PlainTensor | ExpertPieces] = []
    shapes: dict[str, tuple[int, ...]] = {}  # every source tensor the plan reads, with its expected shape

    def plain(items):
        for name, shape in items:
            plan.append(PlainTensor(name, shape))
            shapes[name] = shape

    def layer(p: str, rad_layer: int, layer_type: str, moe: bool):
        plain(expected_layer(cfg, p, layer_type, moe))
        if moe:
            plan.extend(_layer_experts(cfg, p, rad_layer, src, shapes))

    plain([("model.embed_tokens.weight", (cfg.vocab_size, H))])
    for i in range(cfg.num_hidden_layers):
        layer(f"model.layers.{i}.", i, cfg.layer_type(i), cfg.is_moe_layer(i))
    plain([("model.norm.weight", (H,))])
    if not cfg.tie_word_embeddings:
        plain([("lm_head.weight", (cfg.vocab_size, H))])
    mtp = sorted({int(m.group(1)) for n in src if (m := _MTP_LAYER.match(n))})
    n_mtp = max(mtp) + 1 if mtp else 0
    if cfg.family == "qwen3_next" and any(n.startswith("mtp.") for n in src):
        plain([("mtp.fc.weight", (H, 2 * H)), ("mtp.pre_fc_norm_embedding.weight", (H,)),
               ("mtp.pre_fc_norm_hidden.weight", (H,)), ("mtp.norm.weight", (H,))])
        for j in range(n_mtp):
            p = f"mtp.layers.{j}."
            layer(p, cfg.num_hidden_layers + j, "full_attention", cfg.num_experts > 0)
    else:
        n_mtp = 0
    _check_source(cfg, shards, shapes)
    return msgspec.structs.replace(cfg, num_mtp_layers=n_mtp), plan


def _layer_experts(cfg: ModelConfig, p: str, rad_layer: int, src: dict[str, SourceTensor],
                   shapes: dict[str, tuple[int, ...]]) -> list[ExpertPieces]:
    """The routed experts of the layer with name prefix `p`, in the layout `src` holds them in;
    adds the source tensors they read, with their expected shapes, to `shapes`."""
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    x = f"{p}mlp.experts."
    fused = f"{x}gate_up_proj" in src
    if fused:
        shapes[f"{x}gate_up_proj"], shapes[f"{x}down_proj"] = (E, 2 * I, H), (E, H, I)
    else:
        for e in range(E):
            shapes.update({f"{x}{e}.gate_proj.weight": (I, H), f"{x}{e}.up_proj.weight": (I, H),
                           f"{x}{e}.down_proj.weight": (H, I)})
    return [ExpertPieces(rad_layer, e, x, fused, I) for e in range(E)]


def _check_source(cfg: ModelConfig, shards: Shards, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every tensor of `shapes` in the source with that shape, and no source tensor left over. A block-scaled
    FP8 matrix's `weight_scale_inv` [ceil(N/128), ceil(K/128)] belongs to its weight (shape checked too)."""
    src, folder = shards.tensors, shards.folder
    for name, shape in list(shapes.items()):
        if f"{name}_scale_inv" in src and len(shape) == 2:
            shapes[f"{name}_scale_inv"] = (-(-shape[0] // 128), -(-shape[1] // 128))
    for name, shape in shapes.items():
        if name not in src:
            raise ConvertError(f"{folder}: tensor {name} is missing (no safetensors file in the folder has it); "
                               f"the weights do not match config.json")
        if src[name].shape != shape:
            raise ConvertError(f"{shards.where(name)}: tensor {name} has shape {list(src[name].shape)}, but "
                               f"config.json implies {list(shape)}; the weights do not match the config")
    for name in src:
        if name in shapes or _IGNORED.search(name) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        raise ConvertError(f"{shards.where(name)}: unexpected tensor {name}: radianced's {cfg.family} model has "
                           f"no such weight (is config.json the one for these weights?)")
