"""The fixed part of the card split: what the card is charged before the elastic region.

Pure: numbers in, `Part`s out (the receipt's lines). `budget.plan` checks the
headroom first and divides what is left (`FixedCharges.elastic`) by placement mode.

- **Headroom**: `--gpu-headroom-mib`, or card - `--gpu-memory-mib`.
- **Resident weights** by class (`WEIGHT_CLASSES`), as stored. Embeddings go where
  `Config.embedding_table` says (the flag, else ram): on the card, or pinned in host RAM with the step's rows gathered
  over the link (kernels/embedding.py); a tied lm_head keeps the one copy on the
  card either way. The loader places exactly this (model/loader.py `load_plan`).
  The MTP head is loaded only when it drafts (`--speculative-method mtp`).
- **Activation workspace** for a step of T = `--max-num-batched-tokens` tokens
  with R = min(T, seqs x (1 + drafts)) sampled rows:
    logits      R sampled rows (sizing.py: `logits_bytes`).
    activations one decoder layer at T tokens (sizing.py: `activation_bytes`).
    graph pool  the same two terms at the largest step graph's rows: R for the
                decode graphs, the largest mixed bucket's tokens and logits rows
                for the mixed ones (graph_shapes.py); they capture into a
                private pool of their own (the fp32 logits of every decode bucket
                stay in it: at most 3.4 x R rows x 4 bytes, inside the logits
                term; each mixed graph's logits and routing record, charged on
                their own), plus CAPTURE_WORKSPACE_BYTES for the capture stream's
                cuBLAS workspace on a CUDA card; none with --enforce-eager.
    libraries   LIBRARY_BYTES (cuBLAS/cuBLASLt workspaces, Triton scratch).
- **Fixed state** per live sequence: recurrent state of every DeltaNet layer
  (Hv x Dk x Dv fp32 + conv channels x (kernel - 1) in the model dtype) times
  `Config.state_copies`; block tables sized for full context (int32 per block
  per paging group); the expert pointer table (int64 per layer and expert). With
  experts on disk a placement mode adds the two disk-tier buffers (one layer's
  routed experts each). GGUF experts that may live in the host pool get the
  card's miss staging rows (`miss_staging`, kernels/stage.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from radianced.card import Card, MiB
from radianced.config import Config
from radianced.graph_shapes import mixed_buckets_of, mixed_logits_rows, no_graphs
from radianced.kernels.formats import is_compact, is_staged
from radianced.receipt import Part, fmt_mib
from radianced.sizing import (
    FP32, SAMPLER_BYTES, WEIGHT_CLASSES, ModelFacts, PagingGroup, activation_bytes, allocator_tail, logits_bytes,
    recurrent_bytes_per_copy, slot_bytes,
)

LIBRARY_BYTES = 32 * MiB  # cuBLAS/cuBLASLt workspaces and Triton scratch
# torch gives each (cuBLAS handle, stream) its own workspace (32 MiB on Hopper): the decode graphs are
# captured on a stream of their own, which gets a second one (measured on the H200: 32.0 MiB).
CAPTURE_WORKSPACE_BYTES = 32 * MiB
BLOCK_TABLE_ENTRY = 4  # int32
EXPERT_POINTER = 8  # int64 address (or index on the CPU)
ROUTING_ID_BYTES = 8  # an int64 expert id in a graph's stacked routing record (tiers/slab.py `record`)


@dataclass(frozen=True)
class FixedCharges:
    """Everything the card is charged before the elastic region, in the receipt's order.

    headroom: bytes of the card left untouched (`Config.headroom_bytes`; plan refuses a
        negative one or one past the free bytes before charging anything else).
    headroom_flag: the flag that set it, as the receipt prints it.
    weights: resident weights on the card, by class.
    host_weights: weights pinned in host RAM instead (the embeddings, unless on the card).
    idle_weights: weights stored in the file and not loaded (the MTP head unless it drafts).
    workspace: logits, activations, graph pool and libraries of one step.
    state: recurrent state, block tables and expert pointers of the live sequences.
    elastic: the card's free bytes less all of the above (may be negative): what the
        placement modes divide.
    """

    headroom: int
    headroom_flag: str
    weights: tuple[Part, ...]
    host_weights: tuple[Part, ...]
    idle_weights: tuple[Part, ...]
    workspace: tuple[Part, ...]
    state: tuple[Part, ...]
    elastic: int


def fixed_charges(card: Card, facts: ModelFacts, cfg: Config, groups: tuple[PagingGroup, ...],
                  max_model_len: int, disk_tier: bool = False) -> FixedCharges:
    """The fixed part of `card`'s split for `facts` under `cfg`, KV in `groups`; `disk_tier`: the split
    homes experts in the model file (no step graph is captured then)."""
    headroom = cfg.headroom_bytes(card.total_bytes)
    flag = f"--gpu-memory-mib {cfg.gpu_memory_mib}" if cfg.gpu_memory_mib is not None \
        else f"--gpu-headroom-mib {cfg.headroom_mib}"
    weights, host_weights, idle = _weights(facts, cfg, card.cuda)
    workspace = _workspace(facts, card, cfg, disk_tier) + _allocator_tails(facts, weights, card)
    state = tuple(_state(facts, cfg, groups, max_model_len, card))
    elastic = card.free_bytes - headroom - sum(p.bytes for p in weights + workspace + state)
    return FixedCharges(headroom, flag, weights, host_weights, idle, workspace, state, elastic)


# Experts one MoE call copies in from the host pool at most (kernels/stage.py; more are read in place). The
# headline's 24 GiB card (int4 Qwen3-Next, 88% hits) misses ~10 experts a layer at b8 of its 80 assignments.
MISS_STAGING_ROWS = 64


def miss_staging(facts: ModelFacts, cfg: Config, cuda: bool) -> tuple[int, int]:
    """(rows, bytes a row) of the card's buffer that a MoE call copies its routed host-pool experts into
    before reading them (kernels/stage.py): on a CUDA card whose experts may live in the host pool (a
    placement other than resident, a --host-pool-mib that holds one), every extent in a staged format
    (`formats.is_staged`: GGUF blocks); (0, 0) otherwise. A row is the widest extent in 16-byte words."""
    if not (cuda and facts.expert_count and cfg.placement != "resident"
            and cfg.host_pool_mib * MiB >= slot_bytes(facts.expert_extent_bytes)
            and facts.expert_formats and all(is_staged(f) for f in facts.expert_formats)):
        return 0, 0
    return min(facts.experts_per_layer, MISS_STAGING_ROWS), (facts.expert_extent_bytes + 15) // 16 * 16


def recurrent_state_charge(per_copy_bytes: int, seqs: int, speculative: int) -> int:
    """Recurrent state charged for `seqs` live sequences: one copy each plus one per draft token."""
    return per_copy_bytes * seqs * (speculative + 1)


def _weights(facts: ModelFacts, cfg: Config, cuda: bool) -> tuple[tuple[Part, ...], tuple[Part, ...], tuple[Part, ...]]:
    """(on the card, pinned in host RAM, not loaded) by class, in the bytes the loader holds: on the CPU
    backend `ModelFacts.cpu_weights` (a compact lm_head its block kernels do not read made dense), on a
    CUDA card `ModelFacts.card_weights` (a compact embedding table dense); a card's share of
    `--tp`, its own (sharding.shard_facts: those of its part of each tensor)."""
    stored = dict(facts.weights)
    holds = facts.cpu_weights if not cuda else facts.card_weights
    w = dict(holds or stored)
    card, host, idle = [], [], []
    tied = _tied(facts)
    dense_table = (_CARD_DENSE,) if cuda and w["embeddings"] != stored["embeddings"] else ()
    for c in WEIGHT_CLASSES:
        n = w[c]
        if c == "embeddings":
            if n and not tied:  # tied: lookups read the lm_head's copy on the card
                (host if cfg.embedding_table == "ram" else card).append(
                    Part(c, n, ", ".join((_embedding_reason(cfg, cuda),) + _compact_formats(facts, c) + dense_table)))
            continue
        if c == "lm_head" and tied:
            ram = ("--embedding-placement ram does not move a tied table",) \
                if cfg.embedding_placement == "ram" else ()
            copy = ("the compact table for lookups and a dense copy for the CPU's lm_head",) if n else ("one copy",)
            card.append(Part("lm_head", w["embeddings"] + n, ", ".join(
                (f"tied to the embeddings: {copy[0]}",) + ram + _compact_formats(facts, "embeddings") + dense_table)))
            continue
        elif c == "mtp" and n and not cfg.drafts_with_mtp(facts.model.num_mtp_layers):
            idle.append(Part("mtp", n, "drafts only with --speculative-method mtp"))
            continue
        if n:
            held = ("held dense",) if n != stored[c] else ()  # the CPU's lm_head in fp8_b128 (cpu_weights)
            card.append(Part(c, n, ", ".join(_compact_formats(facts, c) + held)))
    return tuple(card), tuple(host), tuple(idle)


def _tied(facts: ModelFacts) -> bool:
    """The lm_head is the embedding table (tied, or stored without an lm_head of its own)."""
    return facts.model.tie_word_embeddings or facts.weight("lm_head") == 0


# The receipt's words for a compact embedding table on a CUDA card (model/loader.py `device_weights` says why).
_CARD_DENSE = "dequantized at load to the activations' dtype: the row gather reads dense rows"


def _embedding_reason(cfg: Config, cuda: bool) -> str:
    """The receipt's word on the embedding placement in effect: the flag, or why the default is what it is."""
    if cfg.embedding_placement is not None:
        return f"--embedding-placement {cfg.embedding_placement}"
    if cuda:
        return "--embedding-placement ram, the default: the step's rows read over the link"
    return "--embedding-placement ram, the default"


def _compact_formats(facts: ModelFacts, cls: str) -> tuple[str, ...]:
    """The formats a weight class is stored in, where one of them is compact (the receipt names
    them then); () for plain dtypes, whose receipt lines stay as they were."""
    formats = dict(facts.formats).get(cls, ())
    return formats if any(is_compact(f) for f in formats) else ()


def _workspace(facts: ModelFacts, card: Card, cfg: Config, disk_tier: bool) -> tuple[Part, ...]:
    rows = min(cfg.max_num_batched_tokens, cfg.decode_tokens)
    return (
        _logits(facts, rows),
        _activations(facts, card, cfg),
        _graph_pool(facts, rows, card, cfg, disk_tier),
        Part("libraries", LIBRARY_BYTES, "cuBLAS workspaces, Triton scratch"),
    )


def _allocator_tails(facts: ModelFacts, weights: tuple[Part, ...], card: Card) -> tuple[Part, ...]:
    """What torch's allocator holds past the bytes of the weights placed on a CUDA card (`sizing.allocator_tail`;
    a tied lm_head is the embeddings' tensor). Not under --tp: its loader (model/sharded_loader.py) has not
    placed a card's share on a CUDA card yet, so no tails of its tensors have been measured."""
    on_card = {p.name for p in weights}
    if _tied(facts) and "lm_head" in on_card:
        on_card.add("embeddings")  # the tied lm_head's part holds the embeddings' tensor
    n = sum(b for c, b in facts.card_tails if c in on_card)
    if not (card.cuda and facts.share is None and n):
        return ()
    return (Part("allocator tails", n, "the caching allocator's rounding of the weights' tensors and the rest of "
                 "a large tensor's 2 MiB segment it cannot split off"),)


def _deterministic_rows(facts: ModelFacts, card: Card, cfg: Config, tokens: int) -> int:
    """On a CUDA card under --deterministic, the MoE's fp32 rows (one per routed assignment, summed in a fixed
    order) once more at `tokens`: freed after a layer, their block is split by the next layer's smaller
    tensors, so the next layer's rows take a new one. The same holds inside the step graphs' private pool."""
    m = facts.model
    if not (cfg.deterministic and card.cuda and m.moe_layers):
        return 0
    return tokens * m.num_experts_per_tok * m.hidden_size * FP32


def _activations(facts: ModelFacts, card: Card, cfg: Config) -> Part:
    """One layer's activations at --max-num-batched-tokens, and the deterministic MoE's rows once more (the
    H200's start-up check at 4 layers: the peak passed the receipt by 6.8 MiB without them)."""
    m, T = facts.model, cfg.max_num_batched_tokens
    n = activation_bytes(m, facts.act_bytes, T, card.cuda)
    rows = _deterministic_rows(facts, card, cfg, T)
    if not rows:
        return Part("activations", n, f"one layer at {T} tokens")
    return Part("activations", n + rows, f"one layer at {T} tokens, and the deterministic MoE's fp32 rows once "
                f"more ({fmt_mib(rows)}: the allocator splits their freed block between layers)")


def card_logits_bytes(facts: ModelFacts, rows: int) -> int:
    """The logits of `rows` sampled rows on this card: all of them with the sampler's buffers on a
    single card or card 0 (it gathers the others' and samples), only its lm_head rows' output on
    the other cards of `--tp` (sharding.py)."""
    if facts.share is None or facts.share.rank == 0:
        return logits_bytes(facts.model, facts.act_bytes, rows)
    first, stop = facts.share.vocab
    return rows * (stop - first) * facts.act_bytes


def _logits(facts: ModelFacts, rows: int) -> Part:
    m, act, share = facts.model, facts.act_bytes, facts.share
    if share is not None and share.rank:
        return Part("logits", card_logits_bytes(facts, rows), f"{rows} rows x {share.vocab[1] - share.vocab[0]} "
                                                             f"vocab rows x {act} B: this card's lm_head output, "
                                                             f"gathered to card 0")
    gathered = f", gathered from {share.tp} cards" if share is not None and share.tp > 1 else ""
    return Part("logits", card_logits_bytes(facts, rows), f"{rows} rows x {m.vocab_size} vocab x "
                                                         f"{act + SAMPLER_BYTES} B: lm_head output{gathered} and "
                                                         f"sampler buffers")


def _graph_pool(facts: ModelFacts, rows: int, card: Card, cfg: Config, disk_tier: bool) -> Part:
    """The step graphs' pool (engine/graphs.py): one layer and logits at the largest graph's rows, plus what
    the mixed graphs hold past their capture, one set between them (the largest's, each smaller one writes
    its own into it): fp32 logits and the stacked routing record (int64 ids)."""
    m = facts.model
    none = no_graphs(card.cuda, cfg.enforce_eager, cfg.drafts_with_mtp(m.num_mtp_layers), disk_tier)
    if none is not None:
        return Part("graph pool", 0, f"none: {none}")
    mixed = mixed_buckets_of(bool(m.linear_attention_layers), cfg.max_num_seqs, cfg.max_num_batched_tokens,
                             cfg.decode_tokens)
    tokens = max((rows, *mixed))
    logit_rows = max((rows, *(mixed_logits_rows(t, cfg.decode_tokens) for t in mixed)))
    det = _deterministic_rows(facts, card, cfg, tokens)
    pool = activation_bytes(m, facts.act_bytes, tokens, card.cuda) + det + card_logits_bytes(facts, logit_rows)
    top = max(mixed, default=0)
    held = mixed_logits_rows(top, cfg.decode_tokens) * m.vocab_size * FP32 + \
        top * len(m.moe_layers) * m.num_experts_per_tok * ROUTING_ID_BYTES
    what = f"one layer at {tokens} tokens and logits at {logit_rows} rows"
    if det:
        what += f", the deterministic MoE's fp32 rows once more ({fmt_mib(det)})"
    if mixed:
        what += f", and the logits and routing the mixed graphs hold ({fmt_mib(held)})"
    return Part("graph pool", pool + held + CAPTURE_WORKSPACE_BYTES,
                f"{what}, and the capture stream's cuBLAS workspace, for step graphs")


def _state(facts: ModelFacts, cfg: Config, groups: tuple[PagingGroup, ...], L: int, card: Card) -> Iterable[Part]:
    m, S = facts.model, cfg.max_num_seqs
    per_copy = recurrent_bytes_per_copy(m, facts.act_bytes)
    if per_copy:
        copies = cfg.state_copies
        yield Part("recurrent", recurrent_state_charge(per_copy, S, cfg.speculative),
                   f"{S} seqs x {copies} {'copy' if copies == 1 else 'copies'} x {fmt_mib(per_copy)}; fp32 state and "
                   f"the conv window in the activations' dtype, whatever --kv-cache-dtype")
    entries = sum(g.blocks(L) for g in groups)
    yield Part("block tables", S * entries * BLOCK_TABLE_ENTRY, f"{S} seqs x {entries} blocks x {BLOCK_TABLE_ENTRY} B")
    if facts.expert_count:
        layers, experts = len(m.moe_layers), facts.experts_per_layer
        yield Part("expert pointers", layers * experts * EXPERT_POINTER,
                   f"{layers} layers x {experts} experts x {EXPERT_POINTER} B")
    rows, row = miss_staging(facts, cfg, card.cuda)
    if rows:  # one tensor (tiers/slab.py), held as the caching allocator holds it
        yield Part("miss staging", rows * row + allocator_tail(rows * row),
                   f"{rows} experts x {fmt_mib(row)}: a layer's host-pool misses copied to the card before "
                   f"they are read (GGUF blocks read in place cross the link slowly)")
