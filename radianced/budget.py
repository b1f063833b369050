"""The card split: `plan(card, facts, cfg) -> Receipt`, a pure function.

Numbers in, numbers out: no torch, no I/O. The daemon prints the receipt at
start-up and allocates exactly what it says; `radiancectl plan` prints the same
receipt for a model file and a card size; the tests check it by hand.

The split, top to bottom (SPEC §2):

    card total = in use elsewhere (total - free) + headroom + resident weights
               + activation workspace + fixed state + elastic

Everything but the elastic region is the fixed part (charges.py). The elastic
region is one arena of equal pages (sizing.py: a page is one expert slot, or
whole KV blocks of a dense model), described by a `Room`. Who gets its pages is
one pure function per placement mode, each returning a `Split`:

- `lending` (`auto`, `expert_tiered`): KV and experts lend each other pages.
- `deterministic` (`--deterministic`): experts first, then a fixed KV pool.
- `resident`: every expert has a slot.

and `with_disk_buffers` carves the disk tier's two buffers out of a room first
when experts stay in the file (`--weights-disk-tier`).

Every mode refuses (`PlanError`) when the KV pool cannot hold one full-length
sequence, saying how many MiB are missing and which single flag values would work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from radianced.card import Card, MiB, align_up
from radianced.charges import FixedCharges, fixed_charges, miss_staging
from radianced.config import Config, ConfigError
from radianced.receipt import Part, Receipt, fmt_mib
from radianced.sizing import BLOCK_TOKENS, ModelFacts, PagingGroup, kv_pages, page_bytes, paging_groups

# Pinned host rows that O_DIRECT expert reads land in on their way to the card: reads in flight at a
# time for the disk tier, fewer when the file is read only to fill the slots at start.
DISK_STAGING_ROWS, FILL_STAGING_ROWS = 16, 4


class PlanError(ValueError):
    """No split of this card works for the model and flags; the message says what would."""


class Short(Exception):
    """The card lacks `missing` bytes for `what`: a placement mode's refusal, which `plan` turns
    into a PlanError naming the single flag values that would work."""

    def __init__(self, missing: int, what: str):
        self.missing, self.what = missing, what


# -- the elastic region and who gets it ------------------------------------------


@dataclass(frozen=True)
class Room:
    """The elastic region before a placement mode divides it, and what the modes must fit in it.

    elastic: bytes of the free card left after the fixed charges (and the disk-tier buffers,
        once `with_disk_buffers` took them).
    page_bytes: one page of the arena.
    alloc_granule: the card's allocation unit: the arena's pages and the disk-tier buffers
        are allocated together in whole units.
    disk_buffer_pages: the disk tier's two VRAM buffers, beside the arena (0: none).
    experts: routed experts to place.
    slot_cap: the most expert slots: `experts`, or `--expert-slots` when lower.
    host_slots: the experts the host pool holds (`--host-pool-mib` in pages; 0 for a dense model).
    host_pool_mib: `--host-pool-mib`, for messages.
    disk_tier: `--weights-disk-tier`: experts that fit neither card nor host pool may stay in the file.
    buffer_experts: experts one disk-tier buffer holds: one layer's routed experts in a step,
        min(experts per layer, top-k x `--max-num-batched-tokens`).
    floor_experts: one token's top-k in every MoE layer (lending keeps them above the pinned ones).
    kv_seq_pages: pages of one full-length sequence of KV.
    kv_step_pages: pages of one step's KV growth: T tokens plus one block per live sequence.
    max_model_len: the full length, for messages.
    """

    elastic: int
    page_bytes: int
    alloc_granule: int
    disk_buffer_pages: int
    experts: int
    slot_cap: int
    host_slots: int
    host_pool_mib: int
    disk_tier: bool
    buffer_experts: int
    floor_experts: int
    kv_seq_pages: int
    kv_step_pages: int
    max_model_len: int

    @property
    def arena_pages(self) -> int:
        """The most pages n the elastic bytes hold whose allocation, with the disk-tier buffers
        beside them (charged outside `elastic`), is whole allocator units."""
        if self.elastic < 0:
            return 0
        page, reserved = self.page_bytes, self.disk_buffer_pages
        n = self.elastic // page
        while n > 0 and align_up((n + reserved) * page, self.alloc_granule) > self.elastic + reserved * page:
            n -= 1
        return n

    @property
    def seq_text(self) -> str:
        return f"one full-length sequence of KV ({self.kv_seq_pages} pages, --max-model-len {self.max_model_len})"

    def need(self, pages: int, what: str) -> None:
        """Raise Short unless the elastic bytes hold `pages` pages."""
        if self.elastic < pages * self.page_bytes:
            raise Short(pages * self.page_bytes - self.elastic, what)


@dataclass(frozen=True)
class Split:
    """Who gets the elastic pages: one placement mode's answer for a `Room`.

    mode: "lending" | "deterministic" | "resident" (`Receipt.mode`).
    elastic: the room's elastic bytes beside the disk-tier buffers.
    arena_pages: the pages tenants lease.
    disk_buffer_pages: the disk tier's two VRAM buffers (0: none).
    experts_pinned, experts_host, experts_disk: the experts' homes: slots pinned on the card,
        the host pool, the model file.
    expert_slots: slots at start (pinned included).
    expert_floor: slots KV never takes back.
    kv_buffer_pages: pages experts never take.
    """

    mode: str
    elastic: int
    arena_pages: int
    disk_buffer_pages: int
    experts_pinned: int
    experts_host: int
    experts_disk: int
    expert_slots: int
    expert_floor: int
    kv_buffer_pages: int


def with_disk_buffers(room: Room) -> Room:
    """`room` less the disk tier's two VRAM buffers, a page per expert, one layer's routed
    experts each (two, alternating by layer)."""
    pages = 2 * room.buffer_experts
    return dataclasses.replace(room, elastic=room.elastic - pages * room.page_bytes, disk_buffer_pages=pages)


def resident(room: Room) -> Split:
    """`--placement resident`: every expert has a slot, pinned, and KV holds at least one full
    sequence (and keeps the rest)."""
    E, arena = room.experts, room.arena_pages
    room.need(E + room.kv_seq_pages, f"all {E} experts ({E} slots) plus {room.seq_text}" if E else room.seq_text)
    return Split("resident", room.elastic, arena, room.disk_buffer_pages, experts_pinned=E, experts_host=0,
                 experts_disk=0, expert_slots=E, expert_floor=E, kv_buffer_pages=arena - E)


def deterministic(room: Room) -> Split:
    """`--deterministic`: experts first (up to the slot cap), then the KV pool is exactly one
    `--max-model-len` sequence (if every expert has a slot, KV keeps the rest). Experts without a
    slot go to the host pool, then with `--weights-disk-tier` stay in the file; else it refuses."""
    E, kv_seq, arena = room.experts, room.kv_seq_pages, room.arena_pages
    room.need(kv_seq, room.seq_text)
    slots = min(room.slot_cap, arena - kv_seq)
    host = min(E - slots, room.host_slots)
    if E - slots - host and room.disk_tier:
        room = with_disk_buffers(room)
        room.need(kv_seq, room.seq_text + " beside the disk-tier buffers")
        arena = room.arena_pages
        slots = min(room.slot_cap, arena - kv_seq)
        host = min(E - slots, room.host_slots)
    elif E - slots - host:
        rest = E - slots - host
        raise Short(rest * room.page_bytes, f"{rest} experts fit neither the card ({slots} slots beside "
                                             f"{room.seq_text}) nor the host pool "
                                             f"(--host-pool-mib {room.host_pool_mib})")
    return Split("deterministic", room.elastic, arena, room.disk_buffer_pages, experts_pinned=slots,
                 experts_host=host, experts_disk=E - slots - host, expert_slots=slots, expert_floor=slots,
                 kv_buffer_pages=kv_seq)


def lending(room: Room) -> Split:
    """`auto`, `expert_tiered`: experts that do not fit the host pool (aligned slots) are pinned on
    the card; when the card cannot take them and `--weights-disk-tier` is on, they stay in the file
    instead (none pinned: their slots are cache, like those of host experts). Expert slots take
    every page but a KV buffer of one step's growth (T tokens plus one block per live sequence); KV
    grows by taking slots back, down to the expert floor: pinned experts plus one token's top-k in
    every MoE layer."""
    E, kv_seq, cap = room.experts, room.kv_seq_pages, room.slot_cap
    host = min(E, room.host_slots)
    rest = E - host
    pinned = disk = 0
    if rest and room.disk_tier and (room.arena_pages < rest + kv_seq or cap < rest):
        # their home is the file (the card or --expert-slots cannot keep them all): slots cache
        # them like host experts, none pinned
        room, disk = with_disk_buffers(room), rest
    else:
        pinned = rest
    what = room.seq_text
    if pinned:
        what = (f"{pinned} experts pinned on the card (beyond the host pool, --host-pool-mib "
                f"{room.host_pool_mib}) plus {room.seq_text}")
    room.need(pinned + kv_seq, what)
    if cap < pinned:  # then cap is --expert-slots
        raise PlanError(f"--expert-slots {cap} is below the {pinned} experts that must stay "
                        f"on the card: give at least {pinned}, or more --host-pool-mib, or --weights-disk-tier")
    arena = room.arena_pages
    floor = pinned + min(room.floor_experts, cap - pinned, arena - kv_seq - pinned)
    buffer = min(room.kv_step_pages, arena - floor)  # one step's growth
    return Split("lending", room.elastic, arena, room.disk_buffer_pages, experts_pinned=pinned, experts_host=host,
                 experts_disk=disk, expert_slots=min(cap, arena - buffer), expert_floor=floor, kv_buffer_pages=buffer)


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
    except Short as short:
        fixes = _fixes(card, facts, cfg)
        advice = ("; any one of these would work: " + ", ".join(fixes)) if fixes else \
            "; no single flag change fits it: use a bigger card"
        raise PlanError(f"the card is {fmt_mib(short.missing)} short: {short.what}{advice}") from None


def _plan(card: Card, facts: ModelFacts, cfg: Config) -> Receipt:
    L = _max_model_len(facts, cfg)
    groups = paging_groups(facts, cfg)
    page = page_bytes(facts, groups)
    fixed = fixed_charges(card, facts, cfg, groups, L)
    _check_headroom(card, cfg, fixed)
    mode = resident if cfg.placement == "resident" else deterministic if cfg.deterministic else lending
    split = mode(_room(card, facts, cfg, fixed.elastic, groups, page, L))
    if split.experts_disk:  # the disk tier runs every step eagerly: the graph pool's bytes go to the arena
        lean = fixed_charges(card, facts, cfg, groups, L, disk_tier=True)
        if lean.elastic > fixed.elastic:
            again = mode(_room(card, facts, cfg, lean.elastic, groups, page, L))
            if again.experts_disk:  # else those bytes would take every expert off the disk, and graphs would be
                fixed, split = lean, again  # captured after all: the first split stands, its pool charged unused
    state, host_weights, staging = fixed.state, fixed.host_weights, 0
    if split.disk_buffer_pages:
        state += (Part("disk-tier buffers", split.disk_buffer_pages * page,
                       f"2 x {split.disk_buffer_pages // 2} experts x {fmt_mib(page)}"),)
    if facts.expert_count:
        staging = DISK_STAGING_ROWS if split.experts_disk else FILL_STAGING_ROWS
        host_weights += (Part("expert read staging", staging * page,
                              f"{staging} experts x {fmt_mib(page)}: O_DIRECT reads on their way to the card"),)
    kv_max = split.arena_pages - split.expert_floor
    pool_tokens, sessions = _kv_capacity(groups, page, kv_max, L)
    S = cfg.max_num_seqs
    return Receipt(
        placement=cfg.placement, mode=split.mode, card_total=card.total_bytes, card_free=card.free_bytes,
        headroom=fixed.headroom, headroom_flag=fixed.headroom_flag, weights=fixed.weights,
        host_weights=host_weights, idle_weights=fixed.idle_weights, workspace=fixed.workspace, state=state,
        elastic=split.elastic, page_bytes=page, arena_pages=split.arena_pages,
        disk_buffer_pages=split.disk_buffer_pages, staging_rows=staging, alloc_granule=card.alloc_granule,
        experts=facts.expert_count, expert_extent=facts.expert_extent_bytes, experts_pinned=split.experts_pinned,
        experts_host=split.experts_host, experts_disk=split.experts_disk,
        host_pool=cfg.host_pool_mib * MiB if facts.expert_count else 0, expert_slots=split.expert_slots,
        expert_floor=split.expert_floor, kv_buffer_pages=split.kv_buffer_pages, groups=groups,
        kv_max_pages=kv_max, kv_pool_tokens=pool_tokens, max_model_len=L, max_num_seqs=S,
        full_sessions=sessions, worst_case_percent=100 * pool_tokens // (S * L),
        expert_formats=facts.expert_formats, miss_staging=miss_staging(facts, cfg, card.cuda),
    )


def _max_model_len(facts: ModelFacts, cfg: Config) -> int:
    """`--max-model-len`, 0 resolved to the trained context; refuses one past it."""
    trained = facts.model.max_position_embeddings
    L = cfg.max_model_len or trained
    if L > trained:
        raise PlanError(f"--max-model-len {L} is past the model's trained context ({trained}): "
                        f"give at most {trained}, or 0 for {trained}")
    return L


def _check_headroom(card: Card, cfg: Config, fixed: FixedCharges) -> None:
    """Refuse a headroom past the card (PlanError) or past its free bytes (Short)."""
    if fixed.headroom < 0:
        raise PlanError(f"--gpu-memory-mib {cfg.gpu_memory_mib} is more than the card's "
                        f"{fmt_mib(card.total_bytes)}: give at most {card.total_bytes // MiB}")
    if fixed.headroom > card.free_bytes:
        raise Short(fixed.headroom - card.free_bytes, f"the headroom ({fmt_mib(fixed.headroom)}, "
                                                       f"{fixed.headroom_flag}) is more than the card's "
                                                       f"free {fmt_mib(card.free_bytes)}")


def _room(card: Card, facts: ModelFacts, cfg: Config, elastic: int, groups: tuple[PagingGroup, ...],
          page: int, L: int) -> Room:
    m, E, T, per_layer = facts.model, facts.expert_count, cfg.max_num_batched_tokens, facts.experts_per_layer
    return Room(
        elastic=elastic, page_bytes=page, alloc_granule=card.alloc_granule, disk_buffer_pages=0, experts=E,
        slot_cap=E if cfg.expert_slots is None else min(E, cfg.expert_slots),
        host_slots=cfg.host_pool_mib * MiB // page if E else 0, host_pool_mib=cfg.host_pool_mib,
        disk_tier=cfg.weights_disk_tier, buffer_experts=min(per_layer, m.num_experts_per_tok * T),
        floor_experts=min(m.num_experts_per_tok, per_layer) * len(m.moe_layers),
        kv_seq_pages=kv_pages(groups, page, L),
        kv_step_pages=kv_pages(groups, page, T + cfg.max_num_seqs * BLOCK_TOKENS), max_model_len=L)


def _kv_capacity(groups: tuple[PagingGroup, ...], page: int, kv_max: int, L: int) -> tuple[int, int]:
    """(tokens of one sequence, full-length sequences at once) that `kv_max` KV pages hold."""
    most_blocks = max((page // g.block_bytes for g in groups), default=0)
    tokens = _largest(0, kv_max * most_blocks * BLOCK_TOKENS, lambda n: kv_pages(groups, page, n) <= kv_max)
    sessions = _largest(1, kv_max * max(most_blocks, 1), lambda s: kv_pages(groups, page, L, s) <= kv_max)
    return tokens, sessions


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
        except (Short, PlanError, ConfigError):
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
    if cfg.embedding_table == "vram" and fits(embedding_placement="ram"):
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
