"""Load one rank's share of a `.rad` for `--tp N`: the slices sharding.py assigns to its card,
read from the file's mmap, so no rank reads the whole model.

A sharded tensor is cut in contiguous units (heads, columns, vocab rows): rows for column-parallel
projections (q/k/v, gate/up, the DeltaNet input projections, the embedding table and lm_head),
columns for row-parallel ones (o_proj, down_proj, out_proj). A row slice of the mmap is a view
(no copy, only its pages are read); a column slice is copied, as is the DeltaNet conv1d, whose
channels are [q of every key head | k | v] and so three ranges. Norms and the router are
replicated. Routed experts: the rank's contiguous range of ids, in its expert tiers (engine/tp_memory.py)
or in one slab (`owned_experts`).

Checksums cover whole tensors, so each is verified by one rank (tensor i by rank i mod N) and
each routed expert by its owner: together the ranks check every byte once.

Not split yet, refused with a message: compact tensors and experts (their block scales cut
across rows only where a block allows it), the MTP head, and a card whose query heads read
part of a GQA group the next card also reads (the attention op maps local query head h to
local KV head h // (Hq / Hkv)).
"""

from __future__ import annotations

import torch

from radianced.kernels.formats import FORMATS, is_compact
from radianced.model.config import ModelConfig
from radianced.model.experts import ExpertSource, ResidentExperts
from radianced.model.layers import CausalLM
from radianced.model.loader import build_model
from radianced.model.parallel import Group
from radianced.model.rad import RadFile
from radianced.model.rad_format import RadError
from radianced.sharding import CardShare, card_config, card_share, split_kind

_COLUMNS = ("o_proj.weight", "down_proj.weight", "out_proj.weight")  # row-parallel: the share is columns


def load_shard(rad: RadFile, group: Group, device: torch.device | str = "cpu",
               dtype: torch.dtype | None = None, experts: ExpertSource | None = None) -> CausalLM:
    """Rank `group.rank`'s model of `rad` split over `group.size` ranks, on `device` (cast to `dtype`
    if given). Its `cfg` is the card's (sharding.card_config): the KV cache and recurrent state a
    rank allocates follow it. `experts`: the card's, already placed (its expert tiers:
    engine/tp_memory.py); by default all of them in one slab (`owned_experts`)."""
    m = rad.model
    share = card_share(m, group.rank, group.size)
    _check_splittable(rad, share)
    order = {t.name: i for i, t in enumerate(rad.header.tensors)}

    def weights(name: str) -> torch.Tensor:
        t = rad.tensor(name, verify=order[name] % group.size == group.rank)
        return shard_tensor(t, name, m, share).to(device=device, dtype=dtype or t.dtype)

    if experts is None and rad.header.experts:
        experts = owned_experts(rad, share, device, dtype)
    return build_model(card_config(m, share), weights, experts, group=group)


def shard_tensor(t: torch.Tensor, name: str, m: ModelConfig, share: CardShare) -> torch.Tensor:
    """Card `share`'s part of stored tensor `name` (the whole of a replicated one)."""
    kind = split_kind(name)
    if kind == "replicated":
        return t
    units = {"q_heads": m.num_attention_heads, "kv_heads": m.num_key_value_heads, "k_heads": m.linear_num_key_heads,
             "columns": m.intermediate_size, "shared_columns": m.shared_expert_intermediate_size,
             "vocab": m.vocab_size}[kind]
    first, stop = getattr(share, kind)
    if name.endswith("conv1d.weight"):
        return _conv_channels(t, m, share)
    if name.endswith(_COLUMNS):
        per = t.shape[1] // units
        return t[:, first * per:stop * per].contiguous()
    per = t.shape[0] // units
    return t[first * per:stop * per]


def _conv_channels(t: torch.Tensor, m: ModelConfig, share: CardShare) -> torch.Tensor:
    """The DeltaNet conv1d's channels of the card's key heads: its q, its k and its v channels of
    [q (Hk x Dk) | k (Hk x Dk) | v (Hv x Dv)]."""
    first, stop = share.k_heads
    dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
    r = m.linear_num_value_heads // m.linear_num_key_heads
    keys = m.linear_num_key_heads * dk
    return torch.cat((t[first * dk:stop * dk], t[keys + first * dk:keys + stop * dk],
                      t[2 * keys + first * r * dv:2 * keys + stop * r * dv]))


def owned_experts(rad: RadFile, share: CardShare, device: torch.device | str = "cpu",
                  dtype: torch.dtype | None = None) -> ResidentExperts:
    """The card's routed experts (ids `share.experts` of every decoder layer) in one slab,
    layer-major; each layer's table has all E entries, a foreign expert's pointing at the card's
    first one (the MoE routes foreign assignments there at weight 0: model/layers.py)."""
    m = rad.model
    first, stop = share.experts
    layers = sorted({e.layer for e in rad.header.experts if e.layer < m.num_hidden_layers})
    pieces = [rad.expert(layer, e, verify=True) for layer in layers for e in range(first, stop)]
    gate = pieces[0][0]
    slab = torch.empty((len(pieces), 3 * gate.numel()), dtype=dtype or gate.dtype, device=device)
    for row, (g, u, d) in enumerate(pieces):
        slab[row] = torch.cat((g.flatten(), u.flatten(), d.flatten()))
    tables = {}
    for i, layer in enumerate(layers):
        table = torch.full((m.num_experts,), i * (stop - first), dtype=torch.int64)
        table[first:stop] = torch.arange(i * (stop - first), (i + 1) * (stop - first))
        tables[layer] = table.to(slab.device)
    return ResidentExperts(slab, tables)


def _check_splittable(rad: RadFile, share: CardShare) -> None:
    """RadError naming what this split cannot run yet (the module's docstring lists it)."""
    m, tp = rad.model, share.tp
    compact = [t.name for t in rad.header.tensors if FORMATS[t.dtype].compact]
    compact += [f"the experts of layer {e.layer}" for e in rad.header.experts[:1] if is_compact(e.dtype)]
    if compact:
        raise RadError(f"{rad.path}: {compact[0]} is stored compact; --tp {tp} splits only dense tensors for now: "
                       f"convert the model without --compact / --quantize, or serve it with --tp 1")
    q0, q1 = share.q_heads
    if q1 > q0:
        group = m.num_attention_heads // m.num_key_value_heads
        kv0, kv1 = share.kv_heads
        local = (q1 - q0) // (kv1 - kv0)
        if (q1 - q0) % (kv1 - kv0) or any((q0 + h) // group - kv0 != h // local for h in range(q1 - q0)):
            raise RadError(f"--tp {tp}: card {share.rank}'s query heads {q0}-{q1 - 1} read part of a group of "
                           f"{group} query heads that shares a KV head with the next card; give a --tp that "
                           f"divides the {m.num_key_value_heads} KV heads or is a multiple of them")
