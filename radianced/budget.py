"""The card split: `plan(card, facts, cfg) -> Receipt`, a pure function.

Numbers in, numbers out: no torch, no I/O. The daemon prints the receipt at
start-up and allocates exactly what it says; `radiancectl plan` prints the same
receipt for a model file and a card size; the tests check it by hand.

The split, top to bottom (SPEC §2):

    card total = in use elsewhere (total - free) + headroom + resident weights
               + activation workspace + fixed state + elastic

- **Resident weights** by class (`WEIGHT_CLASSES`), as stored. Embeddings stay
  in pinned host RAM unless `--embedding-placement vram`; a tied lm_head keeps
  the one copy on the card. The MTP head is loaded only with `--speculative`.
- **Activation workspace** for a step of T = `--max-num-batched-tokens` tokens
  with R = min(T, seqs x (1 + drafts)) sampled rows:
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
    graph pool  the same two terms at R tokens: decode CUDA graphs capture into
                a private pool of their own (the fp32 logits of every bucket
                stay in it: at most 3.4 x R rows x 4 bytes, inside the logits
                term), plus CAPTURE_WORKSPACE_BYTES for the capture stream's
                cuBLAS workspace on a CUDA card; none with --enforce-eager.
    libraries   LIBRARY_BYTES (cuBLAS/cuBLASLt workspaces, Triton scratch).
- **Fixed state** per live sequence: recurrent state of every DeltaNet layer
  (Hv x Dk x Dv fp32 + conv channels x (kernel - 1) in the model dtype) times
  `Config.state_copies`; block tables sized for full context (int32 per block
  per paging group); the expert pointer table (int64 per layer and expert); with
  experts on disk, the two disk-tier buffers (one layer's routed experts each).
- **Elastic**: the rest, one arena of equal pages. Page = one expert slot: the
  expert extent rounded up to 4 KiB (`PAGE_ALIGN`). A dense model's page is the
  most whole KV blocks that fit in 2 MiB, so no page carries a torn block. A KV
  block holds `BLOCK_TOKENS` (16) tokens of one paging group: full-attention
  layers x 2 (K and V) x kv_heads x head_dim x dtype bytes per token.

Who gets the elastic pages:

- lending (`auto`, `expert_tiered`): experts that do not fit the host pool
  (aligned slots) are pinned on the card; when the card cannot take them and
  `--weights-disk-tier` is on, they stay in the file instead (none pinned: their
  slots are cache, like those of host experts). Expert slots take every page but a KV
  buffer of one step's growth (T tokens plus one block per live sequence); KV
  grows by taking slots back, down to the expert floor: pinned experts plus one
  token's top-k in every MoE layer.
- `--deterministic`: experts first, then the KV pool is exactly one
  `--max-model-len` sequence (if every expert has a slot, KV keeps the rest).
- `resident`: every expert has a slot and KV holds at least one full sequence.

Every mode refuses (`PlanError`) when the KV pool cannot hold one full-length
sequence, saying how many MiB are missing and which single flag values would work.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fractions import Fraction

import msgspec

from radianced.config import Config, ConfigError
from radianced.model.config import ModelConfig

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

PAGE_ALIGN = 4096  # expert slots and pages are whole 4 KiB pieces (O_DIRECT, any dtype view)
# The CUDA caching allocator hands out a large block in whole 2 MiB units and keeps a tail of 1 MiB or
# less inside the block (counted as allocated): on CUDA the arena asks for whole units (`Card.alloc_granule`).
ALLOC_GRANULE = 2 * MiB
BLOCK_TOKENS = 16  # tokens per KV block, every paging group
DENSE_PAGE_BYTES = 2 * MiB  # a dense model's page: whole KV blocks up to this size
LIBRARY_BYTES = 32 * MiB  # cuBLAS/cuBLASLt workspaces and Triton scratch
# torch gives each (cuBLAS handle, stream) its own workspace (32 MiB on Hopper): the decode graphs are
# captured on a stream of their own, which gets a second one (measured on the H200: 32.0 MiB).
CAPTURE_WORKSPACE_BYTES = 32 * MiB
SAMPLER_BYTES = 20  # per (sampled row, vocab entry): fp32 logits, probs, sorted copy + int64 index
DELTANET_CHUNK = 64  # chunk length of the chunked gated delta rule
# Flash-decoding partials (kernels/attention.py): a decode step splits keys only while splits x
# sequences x KV heads <= 2 x the device's SMs; this bounds the SMs of any device planned for (an
# H200 has 132), so one step's partial rows (split, token) stay under 2 x MAX_SMS / KV heads.
MAX_SMS = 256
ATTENTION_MAX_SPLITS = 32  # kernels/attention.MAX_SPLITS (tests/kernels/test_attention.py holds them equal)
BLOCK_TABLE_ENTRY = 4  # int32
EXPERT_POINTER = 8  # int64 address (or index on the CPU)
# Pinned host rows that O_DIRECT expert reads land in on their way to the card: reads in flight at a
# time for the disk tier, fewer when the file is read only to fill the slots at start.
DISK_STAGING_ROWS, FILL_STAGING_ROWS = 16, 4
FP32 = 4

WEIGHT_CLASSES = ("embeddings", "lm_head", "attention", "norms", "router", "shared experts",
                  "dense MLP", "mtp", "other")


class PlanError(ValueError):
    """No split of this card works for the model and flags; the message says what would."""


class _Short(Exception):
    """The card lacks `missing` bytes for `what` (plan turns this into a PlanError)."""

    def __init__(self, missing: int, what: str):
        self.missing, self.what = missing, what


# -- small pieces with test vectors -------------------------------------------


def align_up(n: int, a: int = PAGE_ALIGN) -> int:
    return -(-n // a) * a


def arena_pages_in(room: int, page: int, granule: int, reserved: int = 0) -> int:
    """The most pages n whose allocation, with `reserved` pages beside them (charged outside `room`),
    is whole `granule` units within room + reserved pages."""
    if room < 0:
        return 0
    n = room // page
    while n > 0 and align_up((n + reserved) * page, granule) > room + reserved * page:
        n -= 1
    return n


def slot_bytes(extent_bytes: int) -> int:
    """An expert slot: the expert's extent rounded up to `PAGE_ALIGN`."""
    return align_up(extent_bytes)


def expert_slots(free_bytes: int, reserved_bytes: int, extent_bytes: int) -> int:
    """Slots in what is left: floor((free - reserved) / aligned slot), never negative."""
    return max(0, (free_bytes - reserved_bytes) // slot_bytes(extent_bytes))


def recurrent_state_charge(per_copy_bytes: int, seqs: int, speculative: int) -> int:
    """Recurrent state charged for `seqs` live sequences: one copy each plus one per draft token."""
    return per_copy_bytes * seqs * (speculative + 1)


def kv_tokens_by_hand(sessions: int, context_tokens: int, held_pct: int = 100) -> int:
    """Pool tokens that `sessions` sessions of `context_tokens` need when each holds
    `held_pct`% of its context (prefix caching keeps earlier turns: about 180%)."""
    return -(-sessions * context_tokens * held_pct // 100)


@dataclass(frozen=True)
class PagingGroup:
    """Layers with one KV layout sharing the token axis; a block holds `block_tokens`
    tokens of K and V for all of them."""

    name: str
    layers: int
    block_tokens: int
    block_bytes: int

    @property
    def token_bytes(self) -> Fraction:
        return Fraction(self.block_bytes, self.block_tokens)

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)


def kv_token_bytes(groups: Iterable[PagingGroup]) -> Fraction:
    """What one context token costs across all paging groups."""
    return sum((g.token_bytes for g in groups), Fraction(0))


def kv_bytes(groups: Iterable[PagingGroup], tokens: int) -> int:
    """Bytes of `tokens` tokens of one sequence, in whole blocks of every group."""
    return sum(g.blocks(tokens) * g.block_bytes for g in groups)


def fmt_mib(n: int | Fraction) -> str:
    return f"{float(n) / MiB:.2f} MiB"


def fmt_gib(n: int | Fraction) -> str:
    return f"{float(n) / GiB:.2f} GiB"


def fmt_unit(n: int) -> str:
    """A power-of-two size as the unit it is: "2 MiB", "4 KiB"."""
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n // KiB} KiB"


def fmt_kib(n: int | Fraction) -> str:
    return f"{float(n) / KiB:.2f} KiB"


# -- the card ----------------------------------------------------------------


@dataclass(frozen=True)
class Card:
    """The device memory the split divides. On CUDA from `mem_get_info`; on the CPU
    backend half of RAM (see `arena.detect_card`); `--card-mib` plans an empty card."""

    total_bytes: int
    free_bytes: int
    cuda: bool = False  # a GPU: the caching allocator's 2 MiB units, decode graphs on their own stream

    def __post_init__(self):
        if not 0 <= self.free_bytes <= self.total_bytes:
            raise ValueError(f"card free bytes {self.free_bytes} must be between 0 and total {self.total_bytes}")

    @property
    def alloc_granule(self) -> int:
        """The allocator's unit for the arena: ALLOC_GRANULE on CUDA, a page of RAM otherwise."""
        return ALLOC_GRANULE if self.cuda else PAGE_ALIGN

    @classmethod
    def from_mib(cls, total_mib: int, free_mib: int | None = None, cuda: bool = False) -> Card:
        return cls(total_mib * MiB, (total_mib if free_mib is None else free_mib) * MiB, cuda)


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
    embeddings: the dtype the model computes in).
    expert_*: the routed (layer, expert) extents of the decoder layers.
    """

    model: ModelConfig
    act_bytes: int
    weights: tuple[tuple[str, int], ...]
    expert_count: int = 0
    expert_extent_bytes: int = 0
    expert_total_bytes: int = 0

    def weight(self, cls: str) -> int:
        return dict(self.weights)[cls]

    @classmethod
    def from_rows(cls, model: ModelConfig, tensors: Iterable[tuple[str, str, tuple[int, ...], int]],
                  experts: Iterable[tuple[int, int, int]]) -> ModelFacts:
        """From the stored tensors (name, dtype, shape, nbytes) and expert extents
        (layer, expert, nbytes). Raises ValueError when the embeddings are missing."""
        sums = dict.fromkeys(WEIGHT_CLASSES, 0)
        act = 0
        for name, _dtype, shape, nbytes in tensors:
            c = weight_class(name)
            if c is not None:
                sums[c] += nbytes
            if c == "embeddings":
                act = nbytes // math.prod(shape)
        if act == 0:
            raise ValueError("the model has no token embeddings (model.embed_tokens.weight)")
        count = extent = total = 0
        for layer, _expert, nbytes in experts:
            if layer >= model.num_hidden_layers:  # the MTP head's experts
                sums["mtp"] += nbytes
                continue
            count, extent, total = count + 1, max(extent, nbytes), total + nbytes
        return cls(model, act, tuple(sums.items()), count, extent, total)

    @classmethod
    def from_header(cls, header) -> ModelFacts:
        """From a `.rad` header: `.model`, `.tensors` (.name .dtype .shape .nbytes),
        `.experts` (.layer .expert .nbytes)."""
        return cls.from_rows(header.model, ((t.name, t.dtype, tuple(t.shape), t.nbytes) for t in header.tensors),
                             ((e.layer, e.expert, e.nbytes) for e in header.experts))

    @classmethod
    def from_config(cls, cfg: ModelConfig, dtype_bytes: int, expert_dtype_bytes: int | None = None) -> ModelFacts:
        """For a model known only by its config, every tensor stored in `dtype_bytes`
        (routed experts in `expert_dtype_bytes`, default the same)."""
        eb = dtype_bytes if expert_dtype_bytes is None else expert_dtype_bytes
        elems, mtp_expert_elems = _class_elements(cfg)
        sums = {c: n * dtype_bytes for c, n in elems.items()}
        sums["mtp"] += mtp_expert_elems * eb
        extent = 3 * cfg.hidden_size * cfg.moe_intermediate_size * eb
        count = len(cfg.moe_layers) * cfg.num_experts
        return cls(cfg, dtype_bytes, tuple(sums.items()), count, extent if count else 0, count * extent)


def _class_elements(m: ModelConfig) -> tuple[dict[str, int], int]:
    """Elements of every resident class, and of the MTP head's routed experts."""
    H, E = m.hidden_size, m.num_experts
    n = dict.fromkeys(WEIGHT_CLASSES, 0)
    n["embeddings"] = m.vocab_size * H
    n["lm_head"] = 0 if m.tie_word_embeddings else m.vocab_size * H
    attn, qk_norms = _attention_elements(m)
    for i in range(m.num_hidden_layers):
        n["norms"] += 2 * H
        if m.layer_type(i) == "full_attention":
            n["attention"] += attn
            n["norms"] += qk_norms
        else:
            key = m.linear_num_key_heads * m.linear_key_head_dim
            val = m.linear_num_value_heads * m.linear_value_head_dim
            nv = m.linear_num_value_heads
            n["attention"] += (H * (2 * key + 2 * val) + H * 2 * nv  # in_proj_qkvz, in_proj_ba
                               + (2 * key + val) * m.linear_conv_kernel_dim  # conv1d
                               + 2 * nv + val * H)  # dt_bias, A_log, out_proj
            n["norms"] += m.linear_value_head_dim
        if m.is_moe_layer(i):
            n["router"] += E * H
            n["shared experts"] += _shared_elements(m)
        else:
            n["dense MLP"] += 3 * H * m.intermediate_size
    n["norms"] += H
    mtp_experts = 0
    if m.num_mtp_layers:
        # fc [H, 2H], pre_fc_norm_embedding, pre_fc_norm_hidden, norm; each layer a
        # gated-attention decoder layer with its own MoE
        n["mtp"] = 2 * H * H + 3 * H + m.num_mtp_layers * (attn + qk_norms + 2 * H + E * H + _shared_elements(m))
        mtp_experts = m.num_mtp_layers * E * 3 * H * m.moe_intermediate_size
    return n, mtp_experts


def _attention_elements(m: ModelConfig) -> tuple[int, int]:
    """(projections, q/k norms) of one full-attention layer."""
    H, d = m.hidden_size, m.head_dim
    q, kv = m.num_attention_heads * d, m.num_key_value_heads * d
    gated = 2 if m.family == "qwen3_next" else 1  # q_proj carries the output gate
    attn = H * q * gated + 2 * H * kv + q * H
    if m.attention_bias:
        attn += q * gated + 2 * kv + H
    return attn, (0 if m.family == "llama" else 2 * d)


def _shared_elements(m: ModelConfig) -> int:
    Is = m.shared_expert_intermediate_size
    return 3 * m.hidden_size * Is + m.hidden_size if Is else 0  # gate/up/down + shared_expert_gate


# -- workspace and state -----------------------------------------------------


def activation_bytes(m: ModelConfig, act: int, tokens: int, cuda: bool = False) -> int:
    """One decoder layer's live activations at `tokens` tokens (see the module docstring); the
    flash-decoding partials only on a CUDA card (the CPU's attention does not split)."""
    H = m.hidden_size
    mixers, mlps = [0], [0]
    if m.full_attention_layers:
        q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
        gated = 2 if m.family == "qwen3_next" else 1
        partial_rows = min(tokens * ATTENTION_MAX_SPLITS, 2 * MAX_SMS // m.num_key_value_heads) if cuda else 0
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


def _graph_pool(m: ModelConfig, act: int, rows: int, card: Card, cfg: Config) -> Part:
    if cfg.enforce_eager:
        return Part("graph pool", 0, "none: --enforce-eager")
    pool = activation_bytes(m, act, rows, card.cuda) + logits_bytes(m, act, rows)
    if not card.cuda:
        return Part("graph pool", pool, f"one layer and logits at {rows} tokens, for decode graphs")
    return Part("graph pool", pool + CAPTURE_WORKSPACE_BYTES,
                f"one layer and logits at {rows} tokens, and the capture stream's cuBLAS workspace, "
                f"for decode graphs")


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


def paging_groups(facts: ModelFacts, cfg: Config) -> tuple[PagingGroup, ...]:
    """kv_attn (the full-attention layers) and, when drafting with MTP, kv_mtp."""
    m = facts.model
    kv_elem = facts.act_bytes  # --kv-cache-dtype auto
    per_layer = 2 * m.num_key_value_heads * m.head_dim * kv_elem
    groups = []
    if m.full_attention_layers:
        n = len(m.full_attention_layers)
        groups.append(PagingGroup("kv_attn", n, BLOCK_TOKENS, BLOCK_TOKENS * n * per_layer))
    if cfg.speculative and m.num_mtp_layers:
        groups.append(PagingGroup("kv_mtp", m.num_mtp_layers, BLOCK_TOKENS,
                                  BLOCK_TOKENS * m.num_mtp_layers * per_layer))
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


# -- the receipt -------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """One line of the receipt: a name, its bytes, and how they were computed."""

    name: str
    bytes: int
    detail: str = ""


@dataclass(frozen=True)
class Receipt:
    """The card split. Every byte count is exact; `lines()` is the text operators read."""

    placement: str
    mode: str  # "lending" | "deterministic" | "resident"
    card_total: int
    card_free: int
    headroom: int
    headroom_flag: str
    weights: tuple[Part, ...]  # on the card
    host_weights: tuple[Part, ...]  # pinned host RAM
    idle_weights: tuple[Part, ...]  # stored, not loaded
    workspace: tuple[Part, ...]
    state: tuple[Part, ...]
    elastic: int
    page_bytes: int
    arena_pages: int
    disk_buffer_pages: int  # the disk tier's two VRAM buffers, allocated with the arena, charged in `state`
    staging_rows: int  # pinned host rows for expert reads from the file (charged in `host_weights`)
    alloc_granule: int  # the card's allocation unit (`Card.alloc_granule`)
    experts: int
    expert_extent: int
    experts_pinned: int
    experts_host: int
    experts_disk: int
    host_pool: int
    expert_slots: int  # slots at start (pinned included)
    expert_floor: int  # slots KV never takes back
    kv_buffer_pages: int  # pages experts never take (lending: one step's growth)
    groups: tuple[PagingGroup, ...]
    kv_max_pages: int
    kv_pool_tokens: int
    max_model_len: int
    max_num_seqs: int
    full_sessions: int
    worst_case_percent: int

    # -- totals ----------------------------------------------------------------

    @property
    def in_use_elsewhere(self) -> int:
        return self.card_total - self.card_free

    @property
    def weights_bytes(self) -> int:
        return sum(p.bytes for p in self.weights)

    @property
    def workspace_bytes(self) -> int:
        return sum(p.bytes for p in self.workspace)

    @property
    def state_bytes(self) -> int:
        return sum(p.bytes for p in self.state)

    @property
    def arena_bytes(self) -> int:
        return self.arena_pages * self.page_bytes

    @property
    def arena_alloc_bytes(self) -> int:
        """What the arena allocates: its pages and the disk-tier buffers, in whole allocator units."""
        return align_up((self.arena_pages + self.disk_buffer_pages) * self.page_bytes, self.alloc_granule)

    @property
    def kv_start_pages(self) -> int:
        return self.arena_pages - self.expert_slots

    @property
    def expert_slot(self) -> int:
        return self.page_bytes if self.experts else 0

    def blocks_per_page(self, group: PagingGroup) -> int:
        return self.page_bytes // group.block_bytes

    def parts(self) -> list[tuple[str, int]]:
        """The top-level split; sums to `card_total`."""
        return [("in use elsewhere", self.in_use_elsewhere), ("headroom", self.headroom),
                ("weights", self.weights_bytes), ("workspace", self.workspace_bytes),
                ("state", self.state_bytes), ("elastic", self.elastic)]

    # -- text ------------------------------------------------------------------

    def lines(self) -> list[str]:
        """The receipt, one fact a line, MiB with two decimals."""
        modes = {"lending": "KV and experts lend each other pages",
                 "deterministic": "--deterministic: experts first, fixed split, no lending",
                 "resident": "every weight on the card"}
        out = [f"placement: {self.placement} ({modes[self.mode]})",
               f"card: {fmt_mib(self.card_total)} total, {fmt_mib(self.card_free)} free, "
               f"{fmt_mib(self.in_use_elsewhere)} in use elsewhere",
               f"headroom: {fmt_mib(self.headroom)} ({self.headroom_flag})"]
        out += [f"weights {p.name}: {fmt_mib(p.bytes)}" + (f" ({p.detail})" if p.detail else "")
                for p in self.weights]
        out.append(f"weights on card: {fmt_mib(self.weights_bytes)}")
        out += [f"host RAM {p.name}: {fmt_mib(p.bytes)} pinned ({p.detail})" for p in self.host_weights]
        out += [f"not loaded {p.name}: {fmt_mib(p.bytes)} ({p.detail})" for p in self.idle_weights]
        out += [f"workspace {p.name}: {fmt_mib(p.bytes)} ({p.detail})" for p in self.workspace]
        out.append(f"workspace: {fmt_mib(self.workspace_bytes)} in total")
        out += [f"state {p.name}: {fmt_mib(p.bytes)} ({p.detail})" for p in self.state]
        out.append(f"elastic: {fmt_mib(self.elastic)} = {self.arena_pages} pages of {fmt_mib(self.page_bytes)}"
                   f" + {fmt_mib(self.elastic - self.arena_bytes)} unpaged")
        buffers = " and the disk-tier buffers" if self.disk_buffer_pages else ""
        out.append(f"arena allocation: {fmt_mib(self.arena_alloc_bytes)} (the pages{buffers} "
                   f"in whole {fmt_unit(self.alloc_granule)} allocator units)")
        if self.experts:
            out += [f"expert slot: {fmt_mib(self.expert_extent)} extent -> {fmt_mib(self.expert_slot)} slot "
                    f"(rounded up to {PAGE_ALIGN // KiB} KiB)",
                    f"experts: {self.experts} routed ({fmt_gib(self.experts * self.expert_extent)}): "
                    f"{self.experts_pinned} pinned on card, {self.experts_host} in host pool, "
                    f"{self.experts_disk} on disk",
                    f"host pool: {fmt_mib(self.experts_host * self.expert_slot)} used of {fmt_mib(self.host_pool)}",
                    f"expert cache: {fmt_gib(self.elastic)} free, "
                    f"{fmt_mib(self.elastic - self.expert_slots * self.expert_slot)} reserved -> "
                    f"{self.expert_slots} slots",
                    f"expert floor: {self.expert_floor} slots KV never takes back"]
        else:
            out.append("expert cache: none (dense model: every page holds KV)")
        for g in self.groups:
            out.append(f"{g.name} {fmt_kib(g.block_bytes)} per {g.block_tokens}-token block "
                       f"({fmt_kib(g.token_bytes)} per token, {g.layers} layers), "
                       f"{self.blocks_per_page(g)} blocks per page")
        out += [f"kv per token: {fmt_kib(kv_token_bytes(self.groups))} in total",
                f"kv pool: {self.kv_start_pages} pages ({fmt_mib(self.kv_start_pages * self.page_bytes)}) at start, "
                f"up to {self.kv_max_pages} pages ({fmt_mib(self.kv_max_pages * self.page_bytes)}) "
                f"= {self.kv_pool_tokens} tokens",
                f"kv: the pool backs {self.worst_case_percent}% of the worst case "
                f"({self.max_num_seqs} seqs x {self.max_model_len} tokens) = {self.full_sessions} "
                f"full-length session{'' if self.full_sessions == 1 else 's'}"]
        return out


# -- plan ----------------------------------------------------------------------


def plan(card: Card, facts: ModelFacts, cfg: Config) -> Receipt:
    """Split `card` for `facts` under `cfg`. Pure.

    Raises PlanError when no split works (the message gives the missing MiB and
    the single flag values that would work) or when a flag contradicts the model
    or the card (a --max-model-len past the trained context, a --gpu-memory-mib
    past the card).
    """
    try:
        return _plan(card, facts, cfg)
    except _Short as short:
        fixes = _fixes(card, facts, cfg)
        advice = ("; any one of these would work: " + ", ".join(fixes)) if fixes else \
            "; no single flag change fits it: use a bigger card"
        raise PlanError(f"the card is {fmt_mib(short.missing)} short: {short.what}{advice}") from None


def _plan(card: Card, facts: ModelFacts, cfg: Config) -> Receipt:
    m = facts.model
    trained = m.max_position_embeddings
    L = cfg.max_model_len or trained
    if L > trained:
        raise PlanError(f"--max-model-len {L} is past the model's trained context ({trained}): "
                        f"give at most {trained}, or 0 for {trained}")
    S, T, act = cfg.max_num_seqs, cfg.max_num_batched_tokens, facts.act_bytes

    headroom = cfg.headroom_bytes(card.total_bytes)
    if headroom < 0:
        raise PlanError(f"--gpu-memory-mib {cfg.gpu_memory_mib} is more than the card's "
                        f"{fmt_mib(card.total_bytes)}: give at most {card.total_bytes // MiB}")
    flag = f"--gpu-memory-mib {cfg.gpu_memory_mib}" if cfg.gpu_memory_mib is not None \
        else f"--gpu-headroom-mib {cfg.headroom_mib}"
    if headroom > card.free_bytes:
        raise _Short(headroom - card.free_bytes, f"the headroom ({fmt_mib(headroom)}, {flag}) is more "
                                                 f"than the card's free {fmt_mib(card.free_bytes)}")

    weights, host_weights, idle = _weights(facts, cfg)
    rows = min(T, cfg.decode_tokens)
    workspace = (
        Part("logits", logits_bytes(m, act, rows),
             f"{rows} rows x {m.vocab_size} vocab x {act + SAMPLER_BYTES} B: lm_head output and sampler buffers"),
        Part("activations", activation_bytes(m, act, T, card.cuda), f"one layer at {T} tokens"),
        _graph_pool(m, act, rows, card, cfg),
        Part("libraries", LIBRARY_BYTES, "cuBLAS workspaces, Triton scratch"),
    )
    groups = paging_groups(facts, cfg)
    page = page_bytes(facts, groups)
    bpp = [page // g.block_bytes for g in groups]
    state = list(_state(facts, cfg, groups, L))
    base = headroom + sum(p.bytes for p in weights + workspace) + sum(p.bytes for p in state)
    elastic = card.free_bytes - base

    def kv_pages(tokens: int, seqs: int) -> int:
        return sum(-(-seqs * g.blocks(tokens) // n) for g, n in zip(groups, bpp))

    E = facts.expert_count
    kv_seq = kv_pages(L, 1)
    host_cap = cfg.host_pool_mib * MiB // page if E else 0
    cap = E if cfg.expert_slots is None else min(E, cfg.expert_slots)
    seq_text = f"one full-length sequence of KV ({kv_seq} pages, --max-model-len {L})"

    def need(pages: int, what: str) -> None:
        if elastic < pages * page:
            raise _Short(pages * page - elastic, what)

    buffer_pages = 0

    def add_disk_buffers() -> int:
        nonlocal elastic, buffer_pages
        per_layer = min(m.num_experts, m.num_experts_per_tok * T)
        buffer_pages = 2 * per_layer
        state.append(Part("disk-tier buffers", buffer_pages * page, f"2 x {per_layer} experts x {fmt_mib(page)}"))
        elastic -= buffer_pages * page
        return arena_pages_in(elastic, page, card.alloc_granule, buffer_pages)

    arena = arena_pages_in(elastic, page, card.alloc_granule)
    pinned = host = disk = 0
    if cfg.placement == "resident":
        mode = "resident"
        need(E + kv_seq, f"all {E} experts ({E} slots) plus {seq_text}" if E else seq_text)
        slots = floor = pinned = E
        buffer = arena - E
    elif cfg.deterministic:
        mode = "deterministic"
        need(kv_seq, seq_text)
        slots = min(cap, arena - kv_seq)
        host = min(E - slots, host_cap)
        if E - slots - host and cfg.weights_disk_tier:
            arena = add_disk_buffers()
            need(kv_seq, seq_text + " beside the disk-tier buffers")
            slots = min(cap, arena - kv_seq)
            host = min(E - slots, host_cap)
            disk = E - slots - host
        elif E - slots - host:
            rest = E - slots - host
            raise _Short(rest * page, f"{rest} experts fit neither the card ({slots} slots beside {seq_text}) "
                                      f"nor the host pool (--host-pool-mib {cfg.host_pool_mib})")
        pinned = floor = slots
        buffer = kv_seq
    else:
        mode = "lending"
        host = min(E, host_cap)
        rest = E - host
        if rest and cfg.weights_disk_tier and (arena < rest + kv_seq or cap < rest):
            # their home is the file (the card or --expert-slots cannot keep them all): slots cache
            # them like host experts, none pinned
            arena = add_disk_buffers()
            disk = rest
        else:
            pinned = rest
        what = seq_text
        if pinned:
            what = (f"{pinned} experts pinned on the card (beyond the host pool, --host-pool-mib "
                    f"{cfg.host_pool_mib}) plus {seq_text}")
        need(pinned + kv_seq, what)
        if cap < pinned:
            raise PlanError(f"--expert-slots {cfg.expert_slots} is below the {pinned} experts that must stay "
                            f"on the card: give at least {pinned}, or more --host-pool-mib, or --weights-disk-tier")
        # the floor: pinned experts plus one token's top-k in every MoE layer
        floor = pinned + min(m.num_experts_per_tok * len(m.moe_layers), cap - pinned, arena - kv_seq - pinned)
        buffer = min(kv_pages(T + S * BLOCK_TOKENS, 1), arena - floor)  # one step's growth
        slots = min(cap, arena - buffer)

    kv_max = arena - floor
    staging = 0
    if E:
        staging = DISK_STAGING_ROWS if disk else FILL_STAGING_ROWS
        host_weights += (Part("expert read staging", staging * page,
                              f"{staging} experts x {fmt_mib(page)}: O_DIRECT reads on their way to the card"),)
    pool_tokens = _largest(0, kv_max * max(bpp, default=0) * BLOCK_TOKENS, lambda n: kv_pages(n, 1) <= kv_max)
    sessions = _largest(1, kv_max * max(bpp, default=1), lambda s: kv_pages(L, s) <= kv_max)
    return Receipt(
        placement=cfg.placement, mode=mode, card_total=card.total_bytes, card_free=card.free_bytes,
        headroom=headroom, headroom_flag=flag, weights=weights, host_weights=host_weights,
        idle_weights=idle, workspace=workspace, state=tuple(state), elastic=elastic, page_bytes=page,
        arena_pages=arena, disk_buffer_pages=buffer_pages, staging_rows=staging, alloc_granule=card.alloc_granule, experts=E, expert_extent=facts.expert_extent_bytes, experts_pinned=pinned,
        experts_host=host, experts_disk=disk, host_pool=cfg.host_pool_mib * MiB if E else 0,
        expert_slots=slots, expert_floor=floor, kv_buffer_pages=buffer, groups=groups,
        kv_max_pages=kv_max, kv_pool_tokens=pool_tokens, max_model_len=L, max_num_seqs=S,
        full_sessions=sessions, worst_case_percent=100 * pool_tokens // (S * L),
    )


def _weights(facts: ModelFacts, cfg: Config) -> tuple[tuple[Part, ...], tuple[Part, ...], tuple[Part, ...]]:
    """(on the card, pinned in host RAM, not loaded) by class."""
    w = dict(facts.weights)
    card, host, idle = [], [], []
    tied = facts.model.tie_word_embeddings or w["lm_head"] == 0
    for c in WEIGHT_CLASSES:
        n = w[c]
        if c == "embeddings":
            if tied:
                n = 0  # lookups read the lm_head's copy on the card
            elif not cfg.embeddings_on_card:
                host.append(Part("embeddings", n, "--embedding-placement ram"))
                n = 0
        elif c == "lm_head" and tied:
            card.append(Part("lm_head", w["embeddings"], "tied to the embeddings: one copy"))
            continue
        elif c == "mtp" and n and not cfg.speculative:
            idle.append(Part("mtp", n, "drafts only with --speculative"))
            continue
        if n:
            card.append(Part(c, n))
    return tuple(card), tuple(host), tuple(idle)


def _state(facts: ModelFacts, cfg: Config, groups: tuple[PagingGroup, ...], L: int) -> Iterable[Part]:
    m, S = facts.model, cfg.max_num_seqs
    per_copy = recurrent_bytes_per_copy(m, facts.act_bytes)
    if per_copy:
        copies = cfg.state_copies
        yield Part("recurrent", recurrent_state_charge(per_copy, S, cfg.speculative),
                   f"{S} seqs x {copies} {'copy' if copies == 1 else 'copies'} x {fmt_mib(per_copy)}")
    entries = sum(g.blocks(L) for g in groups)
    yield Part("block tables", S * entries * BLOCK_TABLE_ENTRY, f"{S} seqs x {entries} blocks x {BLOCK_TABLE_ENTRY} B")
    if facts.expert_count:
        layers = len(m.moe_layers)
        yield Part("expert pointers", layers * m.num_experts * EXPERT_POINTER,
                   f"{layers} layers x {m.num_experts} experts x {EXPERT_POINTER} B")


def _largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The largest v in [lo, hi] with ok(v), for ok true up to a point; lo if none."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


# -- what would work ---------------------------------------------------------


def _fixes(card: Card, facts: ModelFacts, cfg: Config) -> list[str]:
    """Single flag values with which the plan fits (each checked by planning again)."""

    def fits(**change) -> bool:
        try:
            _plan(card, facts, msgspec.structs.replace(cfg, **change))
            return True
        except (_Short, PlanError, ConfigError):
            return False

    def search(field: str, lo: int, hi: int, want_largest: bool) -> int | None:
        """The largest (or smallest) value of `field` in [lo, hi] that fits, or None."""
        def ok(x: int) -> bool:
            return fits(**{field: x})
        if lo > hi:
            return None
        if want_largest:
            return _largest(lo, hi, ok) if ok(lo) else None
        return hi - _largest(0, hi - lo, lambda k: ok(hi - k)) if ok(hi) else None

    m, E = facts.model, facts.expert_count
    out = []
    L = cfg.max_model_len or m.max_position_embeddings
    v = search("max_model_len", 1, min(L, m.max_position_embeddings) - 1, True)
    if v is not None:
        out.append(f"--max-model-len {v}")
    if E and cfg.placement != "resident":
        page = page_bytes(facts, paging_groups(facts, cfg))
        v = search("host_pool_mib", cfg.host_pool_mib + 1, -(-E * page // MiB), False)
        if v is not None:
            out.append(f"--host-pool-mib {v}")
        if not cfg.weights_disk_tier and fits(weights_disk_tier=True):
            out.append("--weights-disk-tier")
    if cfg.placement == "resident" and fits(placement="auto"):
        out.append("--placement auto")
    v = search("max_num_seqs", 1, cfg.max_num_seqs - 1, True)
    if v is not None:
        out.append(f"--max-num-seqs {v}")
    v = search("max_num_batched_tokens", cfg.decode_tokens, cfg.max_num_batched_tokens - 1, True)
    if v is not None:
        out.append(f"--max-num-batched-tokens {v}")
    if cfg.embeddings_on_card and fits(embedding_placement="ram"):
        out.append("--embedding-placement ram")
    if cfg.gpu_memory_mib is not None:
        v = search("gpu_memory_mib", cfg.gpu_memory_mib + 1, card.total_bytes // MiB, False)
        if v is not None:
            out.append(f"--gpu-memory-mib {v}")
    else:
        v = search("gpu_headroom_mib", 0, cfg.headroom_mib - 1, True)
        if v is not None:
            out.append(f"--gpu-headroom-mib {v}")
    return out
