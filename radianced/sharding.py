"""How a model is split over `--tp N` cards: which card holds which heads, columns, vocab rows and
experts (`CardShare`), and so what each card's `ModelFacts` is (`shard_facts`). Pure arithmetic, no
torch: the budget plans each card from its share (tp_plan.py); the execution builds this layout.

Units are split in contiguous ranges, the remainder to the first cards (32 query heads over 3
cards: 11, 11, 10). Megatron-style for the dense parts, expert-parallel for the routed experts:

- **Full attention**: column-parallel by query heads (q_proj with its output gate on Qwen3-Next,
  and its bias); o_proj row-parallel over the same heads (its bias replicated: added once, after
  the all-reduce). A card holds the KV heads its query heads read (a GQA group is Hq / Hkv query
  heads): where a group straddles two cards, or Hkv < N, both hold that KV head. Qwen3-30B's 4 KV
  heads over 8 cards: 1 each; SmolLM2's 9 query / 3 KV heads over 2 cards: 5 + 4 query, 2 + 2 KV
  (head 1 on both). k_proj, v_proj and KV bytes per token follow the card's KV heads.
- **Gated DeltaNet**: by key heads, each with its Hv / Hk value heads: in_proj_qkvz, in_proj_ba,
  conv1d, dt_bias, A_log, out_proj (row-parallel), and so the recurrent state and conv window. Its
  gated norm (one head's width) is replicated.
- **Dense MLP and the shared expert**: gate/up column-parallel, down row-parallel, by intermediate
  columns; the shared expert's sigmoid gate ([1, H]) is replicated.
- **Routed experts**: expert-parallel. Card r owns a contiguous range of expert ids, the same in
  every MoE layer (128 over 2 cards: 0-63 and 64-127), with its own slots, host pool and link; the
  MTP head's experts likewise. Hidden states are whole on every card after each all-reduce, so a
  card runs its own experts on the rows routed to them and the MoE output is one all-reduce, no
  all-to-all. Contiguous ranges keep a card's slot table a plain slice of the whole one.
- **Norms and the router**: replicated; every card routes every token (its top-k says which of
  the card's experts run), so the router logits are T x E on every card.
- **Embeddings and lm_head**: vocab-parallel by rows (tied: the one table serves both). A lookup
  zeroes the rows outside the card's range and one [T, H] all-reduce sums them; the lm_head's
  logits (R x V/N each) are gathered to card 0, which samples (rank 0 broadcasts each step's plan,
  the sampled tokens in it). Not a replicated lm_head on card 0: Qwen3-30B's is 151936 x 2048 x
  2 B = 593.50 MiB, 296.75 MiB a card over 2, and with `--embedding-placement ram` each process
  pins only its rows: one copy of the table across the processes.

A compact matrix (kernels/formats.py) splits as a dense one where the split keeps its blocks whole:
GGUF rows are independent, so any rows; along K (the row-parallel o_proj, down_proj, out_proj) a
card's columns must be whole blocks of 32 or 256 values; fp8_b128's 128 x 128 scale blocks span
rows too, so a card's rows or columns must start on a block, or lie inside one. A split that cuts a
block is refused by name (`SplitError`): no rounding moves a value to another card's scale.

Facts read from a file (`ModelFacts.stored`) give each card the bytes of its tensors' shapes in
their formats (`card_shape`): compact scales and padding, as its loader holds them. Facts from a
config go by their classes' bytes: each sharded part's bytes to the cards in proportion to its
units, rounded cumulatively, so the cards' shares add up to the whole exactly. Either way a replicated part counts once per card (a KV head held by two cards,
twice).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from radianced.kernels.formats import FORMATS, FP8_BLOCK

if TYPE_CHECKING:
    from radianced.model.config import ModelConfig
    from radianced.sizing import ModelFacts

Range = tuple[int, int]  # (first, stop)
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight", "out_proj.weight")  # split along K: a card's share is columns


class SplitError(ValueError):
    """A compact tensor whose split over the cards would cut one of its format's blocks."""


@dataclass(frozen=True)
class CardShare:
    """One card's share of a model split over `tp` cards: (first, stop) ranges of units.

    rank, tp: this card and how many.
    q_heads: full-attention query heads (and the o_proj columns they read).
    kv_heads: the KV heads those query heads read (shared with a neighbour where a group straddles).
    k_heads: Gated DeltaNet key heads, each with its Hv / Hk value heads.
    columns: the dense MLP's intermediate columns. shared_columns: the shared expert's.
    vocab: rows of the embedding table and the lm_head.
    experts: the routed expert ids this card owns in every MoE layer.
    """

    rank: int
    tp: int
    q_heads: Range
    kv_heads: Range
    k_heads: Range
    columns: Range
    shared_columns: Range
    vocab: Range
    experts: Range

    def words(self) -> str:
        """The receipt's line for the share, e.g. 'query heads 0-15, KV heads 0-1, experts 0-63'."""
        names = (("query heads", self.q_heads), ("KV heads", self.kv_heads), ("DeltaNet key heads", self.k_heads),
                 ("MLP columns", self.columns), ("shared expert columns", self.shared_columns),
                 ("vocab rows", self.vocab), ("experts", self.experts))
        return ", ".join(f"{name} {a}-{b - 1}" for name, (a, b) in names if b > a)


def split_range(units: int, rank: int, tp: int) -> Range:
    """Card `rank`'s contiguous range of `units`, the remainder to the first cards."""
    base, extra = divmod(units, tp)
    first = rank * base + min(rank, extra)
    return first, first + base + (rank < extra)


def card_share(m: ModelConfig, rank: int, tp: int) -> CardShare:
    """Card `rank`'s share; units of layers the model lacks (dense MLP layers in an all-MoE model,
    full attention, DeltaNet) are (0, 0)."""
    def split(units: int, used: bool = True) -> Range:
        return split_range(units, rank, tp) if used else (0, 0)

    q = split(m.num_attention_heads, bool(m.full_attention_layers))
    group = m.num_attention_heads // m.num_key_value_heads
    kv = (q[0] // group, (q[1] - 1) // group + 1) if q[1] > q[0] else (0, 0)
    dense = any(not m.is_moe_layer(i) for i in range(m.num_hidden_layers))
    return CardShare(rank, tp, q, kv, split(m.linear_num_key_heads), split(m.intermediate_size, dense),
                     split(m.shared_expert_intermediate_size), split(m.vocab_size), split(m.num_experts))


def split_kind(name: str) -> str:
    """How a stored (non-routed) tensor is split: the `CardShare` field whose units divide it, or
    "replicated"."""
    if "embed_tokens" in name or name.startswith("lm_head"):
        return "vocab"
    if "shared_expert." in name:
        return "shared_columns"
    if "norm" in name or "shared_expert_gate" in name:
        return "replicated"
    if "self_attn." in name:
        if "q_proj." in name or "o_proj.weight" in name:
            return "q_heads"
        return "kv_heads" if "k_proj." in name or "v_proj." in name else "replicated"
    if "linear_attn." in name:
        return "k_heads"
    if ".mlp." in name and name.split(".")[-2] in ("gate_proj", "up_proj", "down_proj"):
        return "columns"
    return "replicated"


def _units(m: ModelConfig, kind: str) -> int:
    return {"q_heads": m.num_attention_heads, "kv_heads": m.num_key_value_heads, "k_heads": m.linear_num_key_heads,
            "columns": m.intermediate_size, "shared_columns": m.shared_expert_intermediate_size,
            "vocab": m.vocab_size, "experts": m.num_experts}[kind]


def card_range(name: str, shape: tuple[int, ...], m: ModelConfig, share: CardShare) -> tuple[int, Range] | None:
    """(the dim, (first, stop) along it) of card `share`'s part of stored tensor `name`: input columns
    (dim 1) of a row-parallel matrix, else rows (dim 0, the DeltaNet conv1d's too: its channels are
    three ranges of the card's key heads, as many as this one); None for a replicated tensor."""
    kind = split_kind(name)
    if kind == "replicated":
        return None
    first, stop = getattr(share, kind)
    dim = 1 if name.endswith(ROW_PARALLEL) else 0
    per = shape[dim] // _units(m, kind)
    return dim, (first * per, stop * per)


def card_shape(name: str, fmt: str, shape: tuple[int, ...], m: ModelConfig, share: CardShare) -> tuple[int, ...]:
    """The shape of card `share`'s part of stored tensor `name` (format `fmt`); SplitError where that
    part cuts a block of a compact format (the module says which splits keep them whole)."""
    split = card_range(name, shape, m, share)
    if split is None:
        return shape
    dim, (a, b) = split
    block = _cut_block(fmt, dim, a, b)
    if block:
        axis, cls = "input columns" if dim == 1 else "rows", "embeddings" if split_kind(name) == "vocab" else "layers"
        convert = f"--quantize {cls}=int8 or {cls}=int4 (blocks of 32 values along a row)" \
            if dim == 0 or _cut_block("q8_0", dim, a, b) == 0 else f"its {cls} dense (no {cls}= in --quantize, no --compact)"
        raise SplitError(f"--tp {share.tp}: card {share.rank}'s {axis} {a}-{b - 1} of {name} would cut its {fmt} "
                         f"blocks of {block} {axis}: give a --tp that splits it on multiples of {block}, convert "
                         f"the model with {convert}, or serve it with --tp 1")
    return tuple(b - a if d == dim else n for d, n in enumerate(shape))


def _cut_block(fmt: str, dim: int, a: int, b: int) -> int:
    """The block size of `fmt` that the part [a, b) along `dim` would cut, or 0 where it keeps them whole."""
    if not FORMATS[fmt].compact or (dim == 0 and fmt != "fp8_b128"):  # GGUF rows are independent
        return 0
    if fmt == "fp8_b128":  # scale blocks along both dims: the part starts on one, or lies inside one
        return 0 if a % FP8_BLOCK == 0 or a // FP8_BLOCK == (b - 1) // FP8_BLOCK else FP8_BLOCK
    block = FORMATS[fmt].block
    return 0 if a % block == 0 and b % block == 0 else block


def _card_rows(facts: ModelFacts, share: CardShare):
    """(name, format, shape, bytes) of the card's part of each stored tensor of `facts`."""
    for name, fmt, shape, _nbytes in facts.stored:
        part = card_shape(name, fmt, shape, facts.model, share)
        yield name, fmt, part, FORMATS[fmt].nbytes(part)


def share_bytes(nbytes: int, units: int, rng: Range) -> int:
    """The bytes of units [first, stop) of a tensor of `nbytes` over `units`, rounded cumulatively."""
    return nbytes * rng[1] // units - nbytes * rng[0] // units


def most_cards(m: ModelConfig) -> tuple[int, str]:
    """(the most cards the model splits over, the units that bound it): every card needs a query
    head, a DeltaNet key head and a routed expert where the model has them."""
    bounds = [(m.vocab_size, "vocab rows")]
    if m.full_attention_layers:
        bounds.append((m.num_attention_heads, "query heads"))
    if m.linear_attention_layers:
        bounds.append((m.linear_num_key_heads, "DeltaNet key heads"))
    if m.num_experts:
        bounds.append((m.num_experts, "routed experts a layer"))
    return min(bounds)


def card_config(m: ModelConfig, share: CardShare) -> ModelConfig:
    """The model as card `share` holds it: its query, KV and DeltaNet heads and its MLP and shared
    expert columns; vocab_size and num_experts stay the whole model's (the sampler on card 0 and
    the router see all of them)."""
    k_heads = share.k_heads[1] - share.k_heads[0]
    return msgspec.structs.replace(
        m, num_attention_heads=share.q_heads[1] - share.q_heads[0],
        num_key_value_heads=share.kv_heads[1] - share.kv_heads[0],
        intermediate_size=share.columns[1] - share.columns[0],
        shared_expert_intermediate_size=share.shared_columns[1] - share.shared_columns[0],
        linear_num_key_heads=k_heads,
        linear_num_value_heads=k_heads * (m.linear_num_value_heads // max(m.linear_num_key_heads, 1)))


def shard_facts(facts: ModelFacts, rank: int, tp: int) -> ModelFacts:
    """Card `rank`'s `ModelFacts` of `facts` split over `tp` cards: its class bytes, its model
    (heads, columns per its share; vocab_size and num_experts stay the whole model's: the sampler
    on card 0 and the router see all of them), its routed experts and `share`."""
    if facts.share is not None:
        raise ValueError(f"facts already card {facts.share.rank} of {facts.share.tp}'s share")
    m = facts.model
    share = card_share(m, rank, tp)
    card_model = card_config(m, share)
    if facts.stored:  # each tensor's card shape, in its format's bytes (SplitError where that cuts a block)
        from radianced.sizing import ModelFacts

        first, stop = share.experts
        card = ModelFacts.from_rows(card_model, _card_rows(facts, share),
                                    (e for e in facts.extents if first <= e[1] < stop))
        return dataclasses.replace(card, share=share)
    if sum(n for _c, _k, n in facts.parts) != sum(n for _c, n in facts.weights):
        raise ValueError("these facts carry no split of their weights (ModelFacts.parts): build them with "
                         "from_rows, from_header or from_config")
    weights = dict.fromkeys((c for c, _n in facts.weights), 0)
    for cls, kind, nbytes in facts.parts:
        weights[cls] += nbytes if kind == "replicated" else share_bytes(nbytes, _units(m, kind), getattr(share, kind))
    E = m.num_experts
    count = share_bytes(facts.expert_count, E, share.experts) if E else 0
    total = share_bytes(facts.expert_total_bytes, E, share.experts) if E else 0
    return dataclasses.replace(facts, model=card_model, weights=tuple(weights.items()), expert_count=count,
                               expert_total_bytes=total, share=share, cpu_weights=(), card_weights=(), card_tails=())
