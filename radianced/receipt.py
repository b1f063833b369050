"""The receipt: the card split as numbers (`Receipt`, made of `Part`s) and as the
text operators read (`Receipt.lines()`: one fact a line, MiB with two decimals).

`budget.plan` makes it; the daemon prints it at start-up and allocates exactly
what it says, `radiancectl plan` prints it for a model file and a card size, and
the arena (`Arena.from_receipt`) and the engine read their sizes from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from radianced.card import PAGE_ALIGN, GiB, KiB, MiB, align_up
from radianced.kernels.formats import expert_formats, is_compact
from radianced.sizing import PagingGroup, kv_token_bytes


def fmt_mib(n: int | Fraction) -> str:
    return f"{float(n) / MiB:.2f} MiB"


def fmt_gib(n: int | Fraction) -> str:
    return f"{float(n) / GiB:.2f} GiB"


def fmt_unit(n: int) -> str:
    """A power-of-two size as the unit it is: "2 MiB", "4 KiB"."""
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n // KiB} KiB"


def fmt_kib(n: int | Fraction) -> str:
    return f"{float(n) / KiB:.2f} KiB"


@dataclass(frozen=True)
class Part:
    """One line of the receipt: a name, its bytes, and how they were computed."""

    name: str
    bytes: int
    detail: str = ""


@dataclass(frozen=True)
class Receipt:
    """The card split. Every byte count is exact; `lines()` is the text operators read.

    placement: `--placement` as given.
    mode: who gets the elastic pages: "lending" | "deterministic" | "resident".
    card_total, card_free: the card's bytes (`Card`).
    headroom: bytes of the card left untouched; headroom_flag: the flag that set it, as printed.
    weights: resident weights on the card, by class.
    host_weights: pinned host RAM (embeddings kept there, the expert read staging).
    idle_weights: stored in the file, not loaded (the MTP head unless it drafts).
    workspace: the activation workspace of one step (logits, one layer, graph pool, libraries).
    state: fixed state for the live sequences (recurrent state, block tables, expert
        pointers), then the disk-tier buffers when there are any.
    elastic: what is left of the free card for the arena (after the disk-tier buffers).
    page_bytes: the arena's page: one expert slot, or whole KV blocks of a dense model.
    arena_pages: the pages tenants lease.
    disk_buffer_pages: the disk tier's two VRAM buffers, allocated with the arena, charged in `state`.
    staging_rows: pinned host rows for expert reads from the file (charged in `host_weights`).
    alloc_granule: the card's allocation unit (`Card.alloc_granule`).
    experts: routed (layer, expert) extents of the decoder layers; expert_extent: the largest.
    expert_formats: the formats the extents are stored in, most bytes first (named on the expert
        slot's line where one is compact: `kernels/formats.py`).
    experts_pinned, experts_host, experts_disk: where the experts' homes are: slots pinned on the
        card, the host pool, the model file; they add up to `experts`.
    host_pool: bytes of the host pool (`--host-pool-mib`; 0 for a dense model).
    expert_slots: slots at start (pinned included).
    expert_floor: slots KV never takes back.
    kv_buffer_pages: pages experts never take (lending: one step's growth).
    groups: the KV paging groups.
    kv_max_pages: the most pages KV can hold: every page but the expert floor.
    kv_pool_tokens: the most tokens of one sequence those pages hold.
    max_model_len: the worst-case context (`--max-model-len`, 0 resolved to the trained one).
    max_num_seqs: live sequences at once.
    full_sessions: max_model_len sequences the KV pool holds at once.
    worst_case_percent: kv_pool_tokens as a percentage of max_num_seqs x max_model_len.
    miss_staging: (rows, bytes a row) of the card's buffer for a MoE call's host-pool misses
        (charges.py `miss_staging`; charged in `state`), (0, 0) for none.
    """

    placement: str
    mode: str
    card_total: int
    card_free: int
    headroom: int
    headroom_flag: str
    weights: tuple[Part, ...]
    host_weights: tuple[Part, ...]
    idle_weights: tuple[Part, ...]
    workspace: tuple[Part, ...]
    state: tuple[Part, ...]
    elastic: int
    page_bytes: int
    arena_pages: int
    disk_buffer_pages: int
    staging_rows: int
    alloc_granule: int
    experts: int
    expert_extent: int
    experts_pinned: int
    experts_host: int
    experts_disk: int
    host_pool: int
    expert_slots: int
    expert_floor: int
    kv_buffer_pages: int
    groups: tuple[PagingGroup, ...]
    kv_max_pages: int
    kv_pool_tokens: int
    max_model_len: int
    max_num_seqs: int
    full_sessions: int
    worst_case_percent: int
    expert_formats: tuple[str, ...] = ()
    miss_staging: tuple[int, int] = (0, 0)

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
    def held_bytes(self) -> int:
        """What start-up leaves allocated on the card: the weights, the state and the arena's allocation
        (which holds the disk-tier buffers the state charges: counted once)."""
        buffers = self.disk_buffer_pages * self.page_bytes
        return self.weights_bytes + self.state_bytes - buffers + self.arena_alloc_bytes

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
            out += [f"expert slot: {fmt_mib(self.expert_extent)} extent{_compact(self.expert_formats)} -> "
                    f"{fmt_mib(self.expert_slot)} slot "
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
            layers = f"{g.layers} layers" + (", the MTP head's included" if g.mtp else "")
            out.append(f"{g.name} {fmt_kib(g.block_bytes)} per {g.block_tokens}-token block in {g.dtype} "
                       f"({fmt_kib(g.token_bytes)} per token, {layers}), {self.blocks_per_page(g)} blocks per page")
        out += [f"kv per token: {fmt_kib(kv_token_bytes(self.groups))} in total",
                f"kv pool: {self.kv_start_pages} pages ({fmt_mib(self.kv_start_pages * self.page_bytes)}) at start, "
                f"up to {self.kv_max_pages} pages ({fmt_mib(self.kv_max_pages * self.page_bytes)}) "
                f"= {self.kv_pool_tokens} tokens",
                f"kv: the pool backs {self.worst_case_percent}% of the worst case "
                f"({self.max_num_seqs} seqs x {self.max_model_len} tokens) = {self.full_sessions} "
                f"full-length session{'' if self.full_sessions == 1 else 's'}"]
        return out


# What a slot holds per weight, for the expert slot's line (layouts: kernels/formats.py).
_QUANTS = {
    "q8_0": "int8, an fp16 scale per 32",
    "q4_0": "int4, an fp16 scale per 32",
    "q4_1": "int4, an fp16 scale and min per 32",
    "q4_k": "int4, 6-bit scales and mins per 32 under fp16 ones per 256",
    "q5_k": "int5, 6-bit scales and mins per 32 under fp16 ones per 256",
    "q6_k": "int6, an int8 scale per 16 under an fp16 one per 256",
    "fp8_b128": "fp8 E4M3, an fp32 scale per 128 x 128",
}


def _compact(formats: tuple[str, ...]) -> str:
    """' (q4_0: int4, an fp16 scale per 32; ...)' where any of the expert `formats` is compact, else ''
    (plain dtypes say nothing); an extent whose down piece differs says both pieces."""
    if not any(is_compact(f) for f in formats):
        return ""
    return f" ({'; '.join(_describe(f) for f in formats)})"


def _describe(fmt: str) -> str:
    gate_up, down = expert_formats(fmt)
    if gate_up == down:
        return f"{fmt}: {_QUANTS.get(fmt, fmt)}"
    return f"gate/up {gate_up}: {_QUANTS.get(gate_up, gate_up)}, down {down}: {_QUANTS.get(down, down)}"
