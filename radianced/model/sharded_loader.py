"""Load one rank's share of a `.rad` for `--tp N`: the slices sharding.py assigns to its card,
read from the file's mmap, so no rank reads the whole model.

A sharded tensor is cut in contiguous units (heads, columns, vocab rows): rows for column-parallel
projections (q/k/v, gate/up, the DeltaNet input projections, the embedding table and lm_head),
columns for row-parallel ones (o_proj, down_proj, out_proj). A row slice of the mmap is a view
(no copy, only its pages are read); a column slice is copied, as is the DeltaNet conv1d, whose
channels are [q of every key head | k | v] and so three ranges. Norms and the router are
replicated. Routed experts: the rank's contiguous range of ids, in its expert tiers (engine/tp_memory.py)
or in one slab (`owned_experts`); compact extents stay compact there, as on one card.

A compact matrix is cut on its blocks (sharding.card_shape refuses a split that would cut one): a
GGUF matrix's rows as rows of its bytes, its input columns as whole blocks of each row; an fp8_b128
matrix's values with the scale blocks they fall in. The card's part then takes the form the device
reads (model/loader.py `device_weights`): on the CPU the block kernels read each card's part in
place (a column part is a copy of whole blocks), and an fp8_b128 lm_head is made dense there, as on
one card (`dense_lm_head`).

Checksums cover whole tensors, so each is verified by one rank (tensor i by rank i mod N) and
each routed expert by its owner: together the ranks check every byte once.

The MTP head (`mtp`, where it drafts) splits as a decoder layer does, by the same names (`mtp.layers.0.*`
as layer `num_hidden_layers`): its attention by heads, its shared expert by columns, its router, norms
and fc replicated; its routed experts are the card's range of the `.rad`'s layer `num_hidden_layers`,
resident in a slab of their own (as on one card).

Not split yet, refused with a message: a card whose query heads read part of a GQA group the next card
also reads (the attention op maps local query head h to local KV head h // (Hq / Hkv)).
"""

from __future__ import annotations

import torch

from radianced.kernels.compact import CompactWeight
from radianced.kernels.dequant import pack_fp8_b128, split_fp8_b128
from radianced.kernels.formats import FORMATS, FP8_BLOCK
from radianced.model.config import ModelConfig
from radianced.model.experts import ExpertSource, ResidentExperts
from radianced.model.layers import CausalLM
from radianced.model.loader import build_model, dense_lm_head, device_weights, refuse_unread_formats
from radianced.model.parallel import Group
from radianced.model.rad import RadFile
from radianced.model.rad_format import RadError
from radianced.sharding import CardShare, SplitError, card_config, card_range, card_shape, card_share


def load_shard(rad: RadFile, group: Group, device: torch.device | str = "cpu",
               dtype: torch.dtype | None = None, experts: ExpertSource | None = None,
               mtp: bool = False) -> CausalLM:
    """Rank `group.rank`'s model of `rad` split over `group.size` ranks, on `device` (plain tensors
    cast to `dtype` if given, compact ones in the form the device reads). Its `cfg` is the card's
    (sharding.card_config): the KV cache and recurrent state a rank allocates follow it. `experts`:
    the card's, already placed (its expert tiers: engine/tp_memory.py); by default all of them in
    one slab (`owned_experts`). `mtp`: with the card's share of the MTP head (`model.mtp`), its
    routed experts resident (the card's "mtp" class)."""
    m = rad.model
    share = card_share(m, group.rank, group.size)
    _check_splittable(rad, share)
    refuse_unread_formats(rad, device)
    order = {t.name: i for i, t in enumerate(rad.header.tensors)}
    cpu = torch.device(device).type == "cpu"

    def part(name: str) -> torch.Tensor | CompactWeight:
        return shard_tensor(rad.tensor(name, verify=order[name] % group.size == group.rank), name, m, share)

    formed = device_weights(rad, device, dtype, read=part)

    def weights(name: str) -> torch.Tensor | CompactWeight:
        w = formed(name)
        return w if cpu else w.to(device)  # on the CPU a compact part stays where its loader put it

    if experts is None and rad.header.experts:
        experts = owned_experts(rad, share, device, dtype)
    mtp_experts = None
    if mtp and rad.header.experts and m.num_mtp_layers:  # build_model refuses a model without
        mtp_experts = ResidentExperts.from_rad(rad, device, dtype, range(m.num_hidden_layers, m.num_hidden_layers + 1),
                                               owned=share.experts)
    model = build_model(card_config(m, share), weights, experts, mtp, mtp_experts, group)
    if cpu:
        dense_lm_head(model)
    return model


def shard_tensor(t: torch.Tensor | CompactWeight, name: str, m: ModelConfig,
                 share: CardShare) -> torch.Tensor | CompactWeight:
    """Card `share`'s part of stored tensor `name` (the whole of a replicated one); a compact one's
    part in the same format (its split checked by `sharding.card_shape`)."""
    split = card_range(name, tuple(t.shape), m, share)
    if split is None:
        return t
    dim, (first, stop) = split
    if name.endswith("conv1d.weight"):
        return _conv_channels(t, m, share)
    if isinstance(t, CompactWeight):
        return _compact_part(t, dim, first, stop)
    return t[:, first:stop].contiguous() if dim == 1 else t[first:stop]


def _compact_part(w: CompactWeight, dim: int, first: int, stop: int) -> CompactWeight:
    """Rows (dim 0) or input columns (dim 1) [first, stop) of a compact matrix whose blocks that range
    keeps whole: a GGUF matrix's rows of bytes (a view) or whole blocks of each row (a copy); an
    fp8_b128 matrix's values and the scale blocks they fall in, packed again."""
    n, k = w.shape
    if w.fmt == "fp8_b128":
        values, scales = split_fp8_b128(w.data.reshape(-1), w.shape)
        blocks = slice(first // FP8_BLOCK, (stop - 1) // FP8_BLOCK + 1)
        values, scales = (values[first:stop], scales[blocks]) if dim == 0 else \
            (values[:, first:stop], scales[:, blocks])
        return CompactWeight(w.fmt, tuple(values.shape), pack_fp8_b128(values, scales))
    rows = w.data.reshape(n, -1)  # [N, row bytes]
    if dim == 0:
        return CompactWeight(w.fmt, (stop - first, k), rows[first:stop])
    f = FORMATS[w.fmt]
    cut = rows[:, first // f.block * f.block_bytes:stop // f.block * f.block_bytes]
    return CompactWeight(w.fmt, (n, stop - first), cut.contiguous())


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
    """The card's routed experts (ids `share.experts` of every decoder layer) in one slab
    (`ResidentExperts.from_rad`'s: compact extents as their bytes), layer-major; each layer's table
    has all E entries, a foreign expert's pointing at the card's first one (the MoE routes foreign
    assignments there at weight 0: model/layers.py)."""
    return ResidentExperts.from_rad(rad, device, dtype, owned=share.experts)


def _check_splittable(rad: RadFile, share: CardShare) -> None:
    """RadError naming what this split cannot run (the module's docstring lists it)."""
    m, tp = rad.model, share.tp
    try:
        for t in rad.header.tensors:
            card_shape(t.name, t.dtype, tuple(t.shape), m, share)
    except SplitError as e:
        raise RadError(f"{rad.path}: {e}") from None
    q0, q1 = share.q_heads
    if q1 > q0:
        group = m.num_attention_heads // m.num_key_value_heads
        kv0, kv1 = share.kv_heads
        local = (q1 - q0) // (kv1 - kv0)
        if (q1 - q0) % (kv1 - kv0) or any((q0 + h) // group - kv0 != h // local for h in range(q1 - q0)):
            raise RadError(f"--tp {tp}: card {share.rank}'s query heads {q0}-{q1 - 1} read part of a group of "
                           f"{group} query heads that shares a KV head with the next card; give a --tp that "
                           f"divides the {m.num_key_value_heads} KV heads or is a multiple of them")
