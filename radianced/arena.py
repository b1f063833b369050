"""The elastic region: one device allocation cut into equal pages, leased to tenants.

Two tenants share it (DESIGN.md "Memory model"): KV blocks (`KV`) and expert
slots (`EXPERTS`). A page belongs to at most one tenant. A `Policy` says who may
take what:

- `LendingPolicy`: a tenant takes free pages first (experts leave `kv_buffer`
  free pages to KV), then takes pages back from tenants that can give them up,
  cheapest to get back per byte first (one eviction order for the whole arena);
  expert slots are taken back only down to `expert_floor`, and the KV tenant
  only ever gives up pages no live request uses (its reclaimer's contract).
  A lease never takes the asking tenant's own pages: only the tenant can count
  what recycling its own gains (a KV page holds free blocks its pool has already
  counted), so it recycles them itself, first when they cost no more to get back
  than the cheapest page of another tenant (`cheapest_other`), and leases the rest.
- `FixedPolicy` (`--deterministic`): each tenant has a quota; no lending.

Reuse after eviction: a released page is free at once. A step already queued
may still read its old contents, but the page's next tenant writes it only from
work queued behind that step on the same stream (slot refills, the KV writes of
a later step), so stream order keeps the old readers first; on the CPU the step
has finished when the call returns.

The arena knows pages only; what a page holds is the tenant's business
(`page_view`, `paged_view` interpret the bytes).

Under `--tp N` rank 0's block ids index every card's KV pages, so the other
cards' arenas follow rank 0's KV tenant: rank 0's arena `record`s that tenant's
leases and releases, and each other card applies them (`take`, `release`) to its
own (engine/tp_memory.py).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from dataclasses import dataclass
from typing import Protocol

import torch

from radianced.receipt import Receipt

KV, EXPERTS = "kv", "experts"
TENANTS = (KV, EXPERTS)  # tie-break of the eviction order


class OutOfPages(RuntimeError):
    """A lease could not be filled now; nothing was leased (pages taken back stay free)."""


PageChange = tuple[bool, tuple[int, ...]]  # (leased: True, released: False; the pages), in the order made


@dataclass(frozen=True)
class Lease:
    """Pages held by one tenant. Plain data: releasing any subset the tenant holds is fine."""

    tenant: str
    pages: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.pages)


class Reclaimer(Protocol):
    """A tenant's side of eviction; the arena calls it while filling another tenant's
    lease (never the tenant's own: see `Arena.cheapest_other`) and must not be re-entered from it."""

    def reclaim_cost(self) -> float:
        """Cost per byte of getting back the cheapest page it can give up now; math.inf if none."""

    def surrenderable(self) -> int:
        """Pages `surrender` could give up now."""

    def surrender(self, n: int) -> Lease:
        """Give up to n pages (cheapest first), forgetting what they held; returns them.
        May return fewer, even none."""


class Policy(Protocol):
    def quota(self, tenant: str) -> int | None:
        """Most pages `tenant` may hold, or None for no cap."""

    def free_allowance(self, tenant: str, free: int) -> int:
        """How many of `free` free pages `tenant` may take."""

    def reclaimable(self, requester: str, victim: str, held: int) -> int:
        """How many of the `held` pages of `victim` `requester` (another tenant) may take back."""


@dataclass(frozen=True)
class LendingPolicy:
    expert_floor: int = 0  # expert slots KV never takes back
    kv_buffer: int = 0  # free pages experts leave for KV

    def quota(self, tenant: str) -> int | None:
        return None

    def free_allowance(self, tenant: str, free: int) -> int:
        return max(0, free - self.kv_buffer) if tenant == EXPERTS else free

    def reclaimable(self, requester: str, victim: str, held: int) -> int:
        if victim == EXPERTS:  # KV takes slots back down to the floor (the slab swaps its own slots itself)
            return max(0, held - self.expert_floor)
        return held  # KV's reclaimer gives up only pages no live request uses


@dataclass(frozen=True)
class FixedPolicy:
    quotas: tuple[tuple[str, int], ...]  # (tenant, pages)

    def quota(self, tenant: str) -> int | None:
        return dict(self.quotas).get(tenant, 0)

    def free_allowance(self, tenant: str, free: int) -> int:
        return free

    def reclaimable(self, requester: str, victim: str, held: int) -> int:
        return 0  # no lending: a tenant recycles only its own pages, itself


def policy_for(receipt: Receipt) -> Policy:
    """The policy a receipt's split implies."""
    if receipt.mode == "lending":
        return LendingPolicy(expert_floor=receipt.expert_floor, kv_buffer=receipt.kv_buffer_pages)
    return FixedPolicy(((EXPERTS, receipt.expert_slots), (KV, receipt.kv_start_pages)))


@dataclass(frozen=True)
class ArenaStats:
    held: tuple[tuple[str, int], ...]  # pages per tenant
    free: int
    moved: tuple[tuple[tuple[str, str], int], ...]  # ((from, to), pages taken back)


class Arena:
    def __init__(self, num_pages: int, page_bytes: int, device: torch.device | str = "cpu",
                 policy: Policy | None = None, reserved_pages: int = 0, alloc_bytes: int | None = None):
        """num_pages leasable pages, then `reserved_pages` pages no tenant leases (the disk tier's
        buffers, `reserved`); alloc_bytes: the allocation (default: exactly the pages), at least them."""
        if page_bytes <= 0 or page_bytes % 4096:
            raise ValueError(f"page_bytes {page_bytes} must be a positive multiple of 4096")
        self.num_pages, self.page_bytes = num_pages, page_bytes
        self.reserved = range(num_pages, num_pages + reserved_pages)
        self.policy = policy or LendingPolicy()
        total = (num_pages + reserved_pages) * page_bytes
        if alloc_bytes is not None and alloc_bytes < total:
            raise ValueError(f"alloc_bytes {alloc_bytes} is less than the {total} bytes of the pages")
        # storage: uint8, allocated once and never resized; pages first, any allocator rounding after them
        self.storage = torch.empty(alloc_bytes or total, dtype=torch.uint8, device=device)
        self._owner: list[str | None] = [None] * num_pages
        self._free = list(range(num_pages))  # a heap: the lowest page id goes out first
        self._held = Counter({t: 0 for t in TENANTS})
        self._moved: Counter = Counter()
        self._reclaimers: dict[str, Reclaimer] = {}
        self._records: dict[str, deque[PageChange]] = {}  # recorded tenants' changes not yet taken

    @classmethod
    def from_receipt(cls, receipt: Receipt, device: torch.device | str = "cpu") -> Arena:
        """The arena a receipt's elastic line describes, with its policy."""
        return cls(receipt.arena_pages, receipt.page_bytes, device, policy_for(receipt),
                   reserved_pages=receipt.disk_buffer_pages, alloc_bytes=receipt.arena_alloc_bytes)

    def register(self, tenant: str, reclaimer: Reclaimer) -> None:
        """Let the arena take pages back from `tenant` through `reclaimer`."""
        self._reclaimers[tenant] = reclaimer

    # -- leasing -------------------------------------------------------------------

    def held(self, tenant: str) -> int:
        return self._held[tenant]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def available(self, tenant: str) -> int:
        """Pages `tenant` may lease now: free ones it may use, plus what the policy lets it
        take back from the other tenants' reclaimers."""
        n = self.usable(tenant)
        for victim, r in self._reclaimers.items():
            if victim != tenant:
                n += min(self.policy.reclaimable(tenant, victim, self._held[victim]), r.surrenderable())
        return n

    def cheapest_other(self, tenant: str) -> float:
        """The cost per byte of the cheapest page `lease` could take back for `tenant` from another tenant
        (math.inf if none): what `tenant` weighs recycling its own pages against (the module docstring)."""
        return min((r.reclaim_cost() for t, r in self._reclaimers.items()
                    if t != tenant and self.policy.reclaimable(tenant, t, self._held[t]) > 0), default=math.inf)

    def lease(self, tenant: str, n: int) -> Lease:
        """n pages for `tenant`, all or nothing; the lowest free page ids first.

        Takes free pages the policy allows; if short, takes pages back from the
        other registered tenants, cheapest to get back per byte first, until the
        free pages cover n. Raises OutOfPages when the quota forbids it or the pages
        are not there now (pages taken back meanwhile stay free for the next call).
        """
        quota = self.policy.quota(tenant)
        if quota is not None and self._held[tenant] + n > quota:
            raise OutOfPages(f"{tenant}: {self._held[tenant]} pages held + {n} asked is past its quota of {quota}")
        exhausted: set[str] = set()
        while self.usable(tenant) < n:
            victim = self._cheapest_victim(tenant, exhausted)
            if victim is None:
                break
            allowed = self.policy.reclaimable(tenant, victim, self._held[victim])
            given = self._reclaimers[victim].surrender(min(n - self.usable(tenant), allowed))
            if not given.pages:
                exhausted.add(victim)
                continue
            if given.tenant != victim:
                raise ValueError(f"{victim}'s reclaimer surrendered pages of {given.tenant}")
            self.release(given)
            self._moved[(victim, tenant)] += len(given)
        if self.usable(tenant) < n:
            raise OutOfPages(f"{tenant}: asked for {n} pages, {self.usable(tenant)} usable now "
                             f"({len(self._free)} free)")
        pages = tuple(heapq.heappop(self._free) for _ in range(n))
        for p in pages:
            self._owner[p] = tenant
        self._held[tenant] += n
        self._note(tenant, True, pages)
        return Lease(tenant, pages)

    def take(self, tenant: str, pages: tuple[int, ...]) -> Lease:
        """Lease exactly `pages`, free ones, to `tenant`, whatever the policy says: another arena's
        lease, followed here (`record`). Raises ValueError, changing nothing, for a page not free."""
        taken = [p for p in pages if not 0 <= p < self.num_pages or self._owner[p] is not None]
        if taken or len(set(pages)) != len(pages):
            raise ValueError(f"{tenant}: pages {taken or pages} are not free pages of this arena, each once")
        wanted = set(pages)
        self._free = [p for p in self._free if p not in wanted]
        heapq.heapify(self._free)
        for p in pages:
            self._owner[p] = tenant
        self._held[tenant] += len(pages)
        self._note(tenant, True, tuple(pages))
        return Lease(tenant, tuple(pages))

    def owner(self, page: int) -> str | None:
        """The tenant holding `page`, or None when it is free."""
        return self._owner[page]

    def record(self, tenant: str) -> None:
        """Keep `tenant`'s leases and releases from now on, for `changes`."""
        self._records[tenant] = deque()

    def changes(self, tenant: str) -> list[PageChange]:
        """`tenant`'s leases and releases since the last call, in order (`record` first). Safe while
        another thread leases: each change comes out once, whole."""
        q, out = self._records[tenant], []
        while q:
            out.append(q.popleft())
        return out

    def release(self, lease: Lease) -> None:
        """Give back `lease`'s pages; they are free at once (see the module docstring).

        Raises ValueError, changing nothing, if any page is not held by lease.tenant.
        """
        for p in lease.pages:
            if not 0 <= p < self.num_pages or self._owner[p] != lease.tenant:
                raise ValueError(f"page {p} is not held by {lease.tenant}")
        if len(set(lease.pages)) != len(lease.pages):
            raise ValueError(f"lease lists a page twice: {lease.pages}")
        for p in lease.pages:
            self._owner[p] = None
            heapq.heappush(self._free, p)
        self._held[lease.tenant] -= len(lease)
        self._note(lease.tenant, False, lease.pages)

    def stats(self) -> ArenaStats:
        return ArenaStats(tuple((t, self._held[t]) for t in TENANTS), len(self._free),
                          tuple(sorted(self._moved.items())))

    def _note(self, tenant: str, leased: bool, pages: tuple[int, ...]) -> None:
        q = self._records.get(tenant)
        if q is not None and pages:
            q.append((leased, pages))

    def usable(self, tenant: str) -> int:
        """Free pages `tenant` may lease now (without taking any back)."""
        return min(len(self._free), self.policy.free_allowance(tenant, len(self._free)))

    def _cheapest_victim(self, requester: str, exhausted: set[str]) -> str | None:
        best, best_cost = None, math.inf
        for t in TENANTS:
            r = self._reclaimers.get(t)
            if r is None or t == requester or t in exhausted \
                    or self.policy.reclaimable(requester, t, self._held[t]) <= 0:
                continue
            cost = r.reclaim_cost()
            if cost < best_cost:
                best, best_cost = t, cost
        return best

    # -- interpreting pages --------------------------------------------------------

    def page_view(self, page: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Page `page`'s first bytes as a [*shape] `dtype` tensor (a view, no copy)."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        self._check_fits(nbytes, shape, dtype)
        start = page * self.page_bytes
        return self.storage[start:start + nbytes].view(dtype).view(shape)

    def paged_view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Every page, the reserved ones last, as [num_pages + len(reserved), *shape] `dtype` (a view):
        a tenant indexes it by its page ids.

        Each page's bytes past the shape are left out (e.g. KV: [P, N, L, 2, S, Hkv, D]).
        """
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        self._check_fits(nbytes, shape, dtype)
        n = self.num_pages + len(self.reserved)
        pages = self.storage[:n * self.page_bytes].view(n, self.page_bytes)[:, :nbytes]  # [P, nbytes], strides (page, 1)
        return pages.view(dtype).view(n, *shape)

    def _check_fits(self, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if nbytes > self.page_bytes:
            raise ValueError(f"{list(shape)} {dtype} needs {nbytes} bytes; a page holds {self.page_bytes}")


class TenantPages:
    """One tenant's side of the arena as a block pool's page source (`kv.blocks.PageSource`)."""

    def __init__(self, arena: Arena, tenant: str):
        self.arena, self.tenant = arena, tenant

    def available(self) -> int:
        return self.arena.available(self.tenant)

    def lease(self, n: int) -> list[int]:
        return list(self.arena.lease(self.tenant, n).pages)

    def cheaper_than_recycling(self, own_cost: float) -> int:
        return self.arena.available(self.tenant) if self.arena.cheapest_other(self.tenant) < own_cost \
            else self.arena.usable(self.tenant)

    def give_back(self, pages) -> None:
        self.arena.release(Lease(self.tenant, tuple(pages)))

