"""What a model costs on the card, in bytes: pure arithmetic on a `ModelFacts`, no torch.

- **Weights** by class (`WEIGHT_CLASSES`), as stored (`ModelFacts.from_header`)
  or as a config implies them (`ModelFacts.from_config`); routed experts are
  counted from their extents. A stored class also records its formats (a plain
  dtype or a compact format, `kernels/formats.py`): compact weights are counted
  at their compact bytes, and an expert slot is the compact extent.
- **Activations** of a step of T = `--max-num-batched-tokens` tokens with R
  sampled rows (the budget charges these as its workspace):
    logits      R x vocab x (act + 20) bytes: the lm_head output in the model
                dtype, then fp32 logits, fp32 probabilities, an fp32 sorted copy
                and its int64 indices (top-p / top-k) = 4 + 4 + 4 + 8.
                Only sampled rows get logits (the model gathers them first).
    activations one decoder layer at T tokens (layers run one after another):
                4 hidden-state buffers [T, H] + the largest mixer (attention:
                q(+gate), k, v, output, on CUDA the flash-decoding partials; DeltaNet:
                projections, conv output, core output, fp32 chunk
                intermediates and per-chunk states) + the
                largest MLP (dense: gate, up, act; MoE: fp32 router logits,
                top-k ids and weights, and per routed row the gathered input,
                gate, up, act and output, plus the shared expert). Attention
                kernels are flash-style: no [T, context] scores.
- **Recurrent state** of one sequence: every DeltaNet layer's Hv x Dk x Dv fp32
  state + conv channels x (kernel - 1) in the model dtype.
- **KV and pages**: page = one expert slot: the expert extent rounded up to
  4 KiB (`PAGE_ALIGN`). A dense model's page is the most whole KV blocks that
  fit in 2 MiB, so no page carries a torn block. A KV block holds
  `BLOCK_TOKENS` (16) tokens of one paging group: full-attention layers x 2
  (K and V) x kv_heads x head_dim x dtype bytes per token with `--kv-cache-dtype
  auto`; a quantized dtype's block is its codes and scales (kernels/kv_formats.py),
  e.g. SmolLM2's 30 layers x 3 heads x 64 dims: 360 KiB auto bf16, 185.63 KiB fp8.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from fractions import Fraction

from radianced.card import MiB, align_up
from radianced.config import Config
from radianced.kernels.formats import CPU_BLOCKS, is_compact
from radianced.kernels.kv_formats import KV_FORMATS
from radianced.model.config import ModelConfig
from radianced.model_elements import class_elements
from radianced.sharding import CardShare, split_kind

BLOCK_TOKENS = 16  # tokens per KV block, every paging group
DENSE_PAGE_BYTES = 2 * MiB  # a dense model's page: whole KV blocks up to this size
SAMPLER_BYTES = 20  # per (sampled row, vocab entry): fp32 logits, probs, sorted copy + int64 index
DELTANET_CHUNK = 64  # chunk length of the chunked gated delta rule
# Flash-decoding partials (kernels/attention.py): splits x sequences x KV heads <= PROGRAMS_PER_SM x SMs, and
# MAX_SMS bounds any device planned for (an H200 has 132): partial rows <= PROGRAMS_PER_SM x MAX_SMS / KV heads.
MAX_SMS = 256
ATTENTION_MAX_SPLITS = 32  # kernels/attention.MAX_SPLITS (tests/kernels/test_attention.py holds them equal)
ATTENTION_PROGRAMS_PER_SM = 8  # kernels/attention.MAX_PROGRAMS_PER_SM (likewise)
FP32 = 4

# bytes per element of the plain `.rad` dtypes (rad_format.DTYPES); a compact format has no element size
PLAIN_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "f8_e4m3": 1}

WEIGHT_CLASSES = ("embeddings", "lm_head", "attention", "norms", "router", "shared experts",
                  "dense MLP", "mtp", "other")


# -- the model ---------------------------------------------------------------

_ROUTED = re.compile(r"\.experts\.")


def weight_class(name: str) -> str | None:
    """The resident class of a stored tensor; None for routed-expert tensors (they
    are counted from the expert extents)."""
    if name.startswith("mtp."):
        return "mtp"
    if _ROUTED.search(name):
        return None
    if "embed_tokens" in name:
        return "embeddings"
    if name.startswith("lm_head"):
        return "lm_head"
    if "shared_expert" in name:
        return "shared experts"
    if "norm" in name:
        return "norms"
    if name.endswith("mlp.gate.weight"):
        return "router"
    if ".mlp." in name:
        return "dense MLP"
    if "self_attn." in name or "linear_attn." in name:
        return "attention"
    return "other"


@dataclass(frozen=True)
class ModelFacts:
    """What the budget needs to know about a model: its config and stored byte sizes.

    weights: bytes of every class of `WEIGHT_CLASSES`, in that order (routed
    experts excluded; the MTP head's own experts included in "mtp").
    act_bytes: bytes of one activation / KV element (the stored dtype of the
    embeddings: the dtype the model computes in; of the final norm when the
    embeddings are compact, as the model does).
    expert_*: the routed (layer, expert) extents of the decoder layers.
    formats: per class that has stored weights, the formats they are stored in
    (`.rad` dtype names, most bytes first), e.g. ("embeddings", ("q8_0",)); empty for
    facts built from a config.
    expert_formats: the formats of the routed extents, most bytes first.
    parts: the weights split by how `--tp` divides them: (class, `sharding.split_kind`, bytes),
    the MTP head's routed experts as kind "experts"; they add up to `weights`.
    share: the card's share when these are one card's facts (`sharding.shard_facts`), else None:
    then `model` has the card's heads and columns, and the weights and experts are the card's.
    cpu_weights: per class, the bytes the host backend holds once loaded where that differs from
    `weights` (a compact lm_head its block kernels do not read made dense: `_cpu_held`;
    a tied compact table's dense lm_head copy as "lm_head"); empty when nothing differs.
    card_weights: the same for a CUDA card (model/loader.py `device_weights`): a compact embedding table
    dequantized to the activations' dtype; every other compact matrix as stored; empty when nothing differs.
    card_tails: per class, what torch's caching allocator holds past those bytes when each of the class's
    tensors is placed on a CUDA card on its own (`allocator_tail`); empty for facts built from a config.
    stored, extents: the rows `from_rows` was given, which `sharding.shard_facts` splits tensor by
    tensor (a compact one in its format's bytes); empty for facts built from a config.
    """

    model: ModelConfig
    act_bytes: int
    weights: tuple[tuple[str, int], ...]
    expert_count: int = 0
    expert_extent_bytes: int = 0
    expert_total_bytes: int = 0
    # descriptions for the receipt: facts from a config and from a header with the same bytes compare equal
    formats: tuple[tuple[str, tuple[str, ...]], ...] = field(default=(), compare=False)
    expert_formats: tuple[str, ...] = field(default=(), compare=False)
    parts: tuple[tuple[str, str, int], ...] = field(default=(), compare=False)
    share: CardShare | None = None
    cpu_weights: tuple[tuple[str, int], ...] = field(default=(), compare=False)
    card_weights: tuple[tuple[str, int], ...] = field(default=(), compare=False)
    card_tails: tuple[tuple[str, int], ...] = field(default=(), compare=False)
    stored: tuple[tuple[str, str, tuple[int, ...], int], ...] = field(default=(), compare=False)
    extents: tuple[tuple, ...] = field(default=(), compare=False)

    def weight(self, cls: str) -> int:
        return dict(self.weights)[cls]

    @property
    def experts_per_layer(self) -> int:
        """Routed experts of one MoE layer on this card: all of them, or the card's share."""
        return self.share.experts[1] - self.share.experts[0] if self.share else self.model.num_experts

    @classmethod
    def from_rows(cls, model: ModelConfig, tensors: Iterable[tuple[str, str, tuple[int, ...], int]],
                  experts: Iterable[tuple]) -> ModelFacts:
        """From the stored tensors (name, dtype, shape, nbytes) and expert extents
        (layer, expert, nbytes[, dtype]: an extent without one names no format). Raises
        ValueError when the embeddings are missing."""
        tensors, experts = tuple(tensors), tuple(experts)
        sums = dict.fromkeys(WEIGHT_CLASSES, 0)
        parts: dict[tuple[str, str], int] = {}
        by_format: dict[str, dict[str, int]] = {}  # class -> format -> bytes
        embed = norm = None
        for name, dtype, _shape, nbytes in tensors:
            c = weight_class(name)
            if c is not None:
                sums[c] += nbytes
                parts[c, split_kind(name)] = parts.get((c, split_kind(name)), 0) + nbytes
                fmts = by_format.setdefault(c, {})
                fmts[dtype] = fmts.get(dtype, 0) + nbytes
            embed = dtype if c == "embeddings" else embed
            norm = dtype if name == "model.norm.weight" else norm
        if embed is None:
            raise ValueError("the model has no token embeddings (model.embed_tokens.weight)")
        act = PLAIN_BYTES.get(embed) or PLAIN_BYTES.get(norm or "", 4)
        held, card = _cpu_held(model, tensors, sums, act), _card_held(tensors, sums, act)
        tails: dict[str, int] = {}
        for name, dtype, shape, nbytes in tensors:
            if (c := weight_class(name)) is not None:
                tails[c] = tails.get(c, 0) + allocator_tail(_card_nbytes(c, dtype, shape, nbytes, act))
        count = extent = total = 0
        expert_fmts: dict[str, int] = {}
        for layer, _expert, nbytes, *dtype in experts:
            if layer >= model.num_hidden_layers:  # the MTP head's experts
                sums["mtp"] += nbytes
                parts["mtp", "experts"] = parts.get(("mtp", "experts"), 0) + nbytes
                continue
            count, extent, total = count + 1, max(extent, nbytes), total + nbytes
            for name in dtype:
                expert_fmts[name] = expert_fmts.get(name, 0) + nbytes
        return cls(model, act, tuple(sums.items()), count, extent, total,
                   tuple((c, _by_bytes(f)) for c, f in by_format.items()), _by_bytes(expert_fmts),
                   tuple((c, k, n) for (c, k), n in parts.items()), cpu_weights=held, card_weights=card,
                   card_tails=tuple((c, n) for c, n in tails.items() if n), stored=tensors, extents=experts)

    @classmethod
    def from_header(cls, header) -> ModelFacts:
        """From a `.rad` header: `.model`, `.tensors` (.name .dtype .shape .nbytes),
        `.experts` (.layer .expert .nbytes, and .dtype where it has one)."""
        return cls.from_rows(header.model, ((t.name, t.dtype, tuple(t.shape), t.nbytes) for t in header.tensors),
                             ((e.layer, e.expert, e.nbytes, *([e.dtype] if hasattr(e, "dtype") else []))
                              for e in header.experts))

    @classmethod
    def from_config(cls, cfg: ModelConfig, dtype_bytes: int, expert_dtype_bytes: int | None = None) -> ModelFacts:
        """For a model known only by its config, every tensor stored in `dtype_bytes`
        (routed experts in `expert_dtype_bytes`, default the same)."""
        eb = dtype_bytes if expert_dtype_bytes is None else expert_dtype_bytes
        elems, mtp_expert_elems = class_elements(cfg)
        parts = {k: n * dtype_bytes for k, n in elems.items() if n}
        if mtp_expert_elems:
            parts["mtp", "experts"] = mtp_expert_elems * eb
        sums = dict.fromkeys(WEIGHT_CLASSES, 0)
        for (c, _kind), n in parts.items():
            sums[c] += n
        extent = 3 * cfg.hidden_size * cfg.moe_intermediate_size * eb
        count = len(cfg.moe_layers) * cfg.num_experts
        return cls(cfg, dtype_bytes, tuple(sums.items()), count, extent if count else 0, count * extent,
                   parts=tuple((c, k, n) for (c, k), n in parts.items()))


# torch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp): a request is rounded up to 512 bytes;
# one of at least 10 MiB (kMinLargeAlloc) gets a segment of its own rounded up to 2 MiB (kRoundLarge), and
# its block keeps the segment's rest when the rest is at most 1 MiB (kSmallSize: too small to split off).
ALLOC_ROUND, LARGE_ALLOC, LARGE_ROUND, SPLIT_MIN = 512, 10 * MiB, 2 * MiB, 1 * MiB


def allocator_tail(nbytes: int) -> int:
    """Bytes torch's CUDA caching allocator counts as allocated past `nbytes` for one tensor of that size:
    its 512-byte rounding, and for a large tensor the unsplit rest of its segment (on the H200 a 593.5 MiB
    embedding table and lm_head were each held as 594 MiB). Smaller tensors share segments, whose rests
    depend on the order of allocation: only their rounding is counted."""
    size = align_up(nbytes, ALLOC_ROUND)
    rest = align_up(size, LARGE_ROUND) - size if size >= LARGE_ALLOC else 0
    return size - nbytes + (rest if rest <= SPLIT_MIN else 0)


def _cpu_held(model: ModelConfig, tensors, stored: dict[str, int], act: int) -> tuple[tuple[str, int], ...]:
    """`ModelFacts.cpu_weights` from the stored rows; () when every class is held as stored. The host
    backend holds every tensor as stored, except a compact lm_head in a format its block kernels do not
    read (`formats.CPU_BLOCKS`), made dense in the activations' dtype at load (model/loader.py): for a
    tied table that dense head is a copy beside it."""
    held = dict(stored)
    for name, dtype, shape, nbytes in tensors:
        if not is_compact(dtype) or dtype in CPU_BLOCKS:
            continue
        if name == "lm_head.weight":
            held["lm_head"] += shape[0] * shape[1] * act - nbytes
        elif name == "model.embed_tokens.weight" and model.tie_word_embeddings:
            held["lm_head"] += shape[0] * shape[1] * act
    return () if held == stored else tuple(held.items())


def _card_held(tensors, stored: dict[str, int], act: int) -> tuple[tuple[str, int], ...]:
    """`ModelFacts.card_weights` from the stored rows; () when every class is held as stored."""
    held = dict(stored)
    for name, dtype, shape, nbytes in tensors:
        if (c := weight_class(name)) is not None:
            held[c] += _card_nbytes(c, dtype, shape, nbytes, act) - nbytes
    return () if held == stored else tuple(held.items())


def _card_nbytes(cls: str, dtype: str, shape: tuple[int, ...], nbytes: int, act: int) -> int:
    """A stored tensor's bytes on a CUDA card: a compact embedding table dense in the activations' dtype
    (model/loader.py `device_weights`), every other tensor as stored."""
    return shape[0] * shape[1] * act if cls == "embeddings" and is_compact(dtype) else nbytes


def _by_bytes(formats: dict[str, int]) -> tuple[str, ...]:
    """Format names, most bytes first."""
    return tuple(sorted(formats, key=lambda f: -formats[f]))


# -- activations and state ---------------------------------------------------


def activation_bytes(m: ModelConfig, act: int, tokens: int, cuda: bool = False) -> int:
    """One decoder layer's live activations at `tokens` tokens (see the module docstring); the
    flash-decoding partials only on a CUDA card (the CPU's attention does not split)."""
    H = m.hidden_size
    mixers, mlps = [0], [0]
    if m.full_attention_layers:
        q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
        gated = 2 if m.family == "qwen3_next" else 1
        partial_rows = min(tokens * ATTENTION_MAX_SPLITS,
                           ATTENTION_PROGRAMS_PER_SM * MAX_SMS // m.num_key_value_heads) if cuda else 0
        partials = partial_rows * m.num_attention_heads * (m.head_dim + 1) * FP32  # fp32 o and lse per head
        mixers.append(tokens * (q * gated + 2 * kv + q) * act + partials)
    if m.linear_attention_layers:
        key = m.linear_num_key_heads * m.linear_key_head_dim
        nv, dk, dv = m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim
        val = nv * dv
        per_token = (2 * key + 2 * val + 2 * nv) + (2 * key + val) + val  # projections, conv out, core out
        fp32 = nv * (dk + dv + DELTANET_CHUNK) * FP32  # per-head k, v and the intra-chunk row
        states = -(-tokens // DELTANET_CHUNK) * nv * dk * dv * FP32  # one state per chunk
        mixers.append(tokens * (per_token * act + fp32) + states)
    if any(not m.is_moe_layer(i) for i in range(m.num_hidden_layers)) and m.intermediate_size:
        mlps.append(tokens * 3 * m.intermediate_size * act)
    if m.moe_layers:
        routed = tokens * m.num_experts_per_tok
        mlps.append(tokens * m.num_experts * FP32 + routed * (8 + FP32)
                    + routed * (2 * H + 3 * m.moe_intermediate_size) * act
                    + tokens * 3 * m.shared_expert_intermediate_size * act)
    return 4 * tokens * H * act + max(mixers) + max(mlps)


def logits_bytes(m: ModelConfig, act: int, rows: int) -> int:
    return rows * m.vocab_size * (act + SAMPLER_BYTES)


def recurrent_bytes_per_copy(m: ModelConfig, act: int) -> int:
    """One sequence's DeltaNet state over all linear-attention layers."""
    if not m.linear_attention_layers:
        return 0
    key = m.linear_num_key_heads * m.linear_key_head_dim
    channels = 2 * key + m.linear_num_value_heads * m.linear_value_head_dim
    recurrent = m.linear_num_value_heads * m.linear_key_head_dim * m.linear_value_head_dim * FP32
    conv = channels * (m.linear_conv_kernel_dim - 1) * act
    return len(m.linear_attention_layers) * (recurrent + conv)


# -- pages and paging groups ------------------------------------------------


def slot_bytes(extent_bytes: int) -> int:
    """An expert slot: the expert's extent rounded up to `PAGE_ALIGN`."""
    return align_up(extent_bytes)


@dataclass(frozen=True)
class PagingGroup:
    """Layers with one KV layout sharing the token axis; a block holds `block_tokens`
    tokens of K and V for all of them.

    name: "kv_attn". layers: how many layers, the MTP head's included where it drafts (`mtp`).
    block_tokens: tokens a block holds. block_bytes: one block, exactly what the cache allocates for it
    (quantized: codes and scales). dtype: the receipt's words for what K and V are stored in
    (`--kv-cache-dtype`).
    """

    name: str
    layers: int
    block_tokens: int
    block_bytes: int
    dtype: str = field(default="auto", compare=False)  # words: groups of one layout compare equal
    mtp: bool = field(default=False, compare=False)  # its last layer is the MTP head's

    @property
    def token_bytes(self) -> Fraction:
        return Fraction(self.block_bytes, self.block_tokens)

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)


def kv_token_bytes(groups: Iterable[PagingGroup]) -> Fraction:
    """What one context token costs across all paging groups."""
    return sum((g.token_bytes for g in groups), Fraction(0))


def kv_block_bytes(m: ModelConfig, layers: int, kv_dtype: str, elem_bytes: int) -> int:
    """One `BLOCK_TOKENS` block of `layers` layers in `kv_dtype` (a `--kv-cache-dtype`; auto: K and V
    in elements of `elem_bytes`): what kv/cache.py allocates for it."""
    if kv_dtype == "auto":
        return BLOCK_TOKENS * layers * 2 * m.num_key_value_heads * m.head_dim * elem_bytes
    return KV_FORMATS[kv_dtype].block_bytes(layers, BLOCK_TOKENS, m.num_key_value_heads, m.head_dim)


def kv_dtype_words(kv_dtype: str, elem_bytes: int) -> str:
    """The receipt's words for a `--kv-cache-dtype`."""
    if kv_dtype == "auto":
        return f"auto: the activations' dtype, {elem_bytes} bytes an element"
    return f"{kv_dtype}: {KV_FORMATS[kv_dtype].describe}"


def paging_groups(facts: ModelFacts, cfg: Config) -> tuple[PagingGroup, ...]:
    """kv_attn: the full-attention layers and, when drafting with MTP, its first MTP layer (full attention of
    the same geometry at the same positions: one more layer in every block), in `--kv-cache-dtype`."""
    m, kv, act = facts.model, cfg.kv_cache_dtype, facts.act_bytes
    words = kv_dtype_words(kv, act)
    groups = []
    if m.full_attention_layers:
        mtp = cfg.drafts_with_mtp(m.num_mtp_layers)
        n = len(m.full_attention_layers) + mtp
        groups.append(PagingGroup("kv_attn", n, BLOCK_TOKENS, kv_block_bytes(m, n, kv, act), words, mtp))
    return tuple(groups)


def page_bytes(facts: ModelFacts, groups: Iterable[PagingGroup]) -> int:
    """One expert slot; a dense model's page holds the most whole KV blocks that fit
    in 2 MiB. Never smaller than the largest KV block."""
    block = max((g.block_bytes for g in groups), default=0)
    if facts.expert_count:
        return max(slot_bytes(facts.expert_extent_bytes), align_up(block))
    if block == 0:
        return DENSE_PAGE_BYTES
    return align_up(max(1, DENSE_PAGE_BYTES // block) * block)


def kv_pages(groups: Iterable[PagingGroup], page: int, tokens: int, seqs: int = 1) -> int:
    """Pages `seqs` sequences of `tokens` tokens take: in every paging group, their blocks
    in pages of whole blocks of that group."""
    return sum(-(-seqs * g.blocks(tokens) // (page // g.block_bytes)) for g in groups)
