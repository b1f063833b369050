"""Where every routed expert lives: on the card, in the host pool, or only in the file. Pure.

`place(experts, pinned=, host=, disk=, slots=, ranking=)` takes the receipt's
counts (`experts_pinned`, `experts_host`, `experts_disk`, `expert_slots`) and
an expert ranking (hottest first: a profile's `rank()`; default the file order)
and returns a `Placement`:

- the `pinned` hottest experts have their home on the card: slots 0..pinned-1,
  never evicted (they have no other copy the step could read);
- the next `host` experts live in the host pool (pinned host RAM, or a tmpfs
  file with `ram=DIR`); pool rows follow the file order, so filling the pool
  reads the file front to back;
- the rest stay in the model file (`--weights-disk-tier`) and are read when a
  step routes to them;
- the cache slots after the pinned ones start with the next-ranked experts
  (`prefill`, rank order), so slot i holds `slots[i]` at start.

A ranking may be partial (a profile lists only the experts it saw): the experts
it leaves out follow in file order. No I/O, no torch: the same numbers give the
same placement, and the tests check it exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

CARD, HOST, DISK = "card", "host", "disk"
HOMES = (CARD, HOST, DISK)

Key = tuple[int, int]  # (layer, expert)


@dataclass(frozen=True)
class Placement:
    """Homes of all routed experts and the slot contents at start.

    pinned: slot order (= rank order); host: pool row order (= file order);
    disk: file order; prefill: cache slots after the pinned ones, rank order.
    """

    pinned: tuple[Key, ...]
    host: tuple[Key, ...]
    disk: tuple[Key, ...]
    prefill: tuple[Key, ...]
    _home: dict[Key, str] = field(repr=False, compare=False)
    _row: dict[Key, int] = field(repr=False, compare=False)

    def home(self, layer: int, expert: int) -> str:
        """CARD, HOST or DISK; KeyError for an expert the model does not have."""
        return self._home[(layer, expert)]

    def host_row(self, layer: int, expert: int) -> int:
        """Row of a host-pool expert; KeyError for one whose home is elsewhere."""
        return self._row[(layer, expert)]

    @property
    def slots(self) -> tuple[Key, ...]:
        """Slot i holds slots[i] at start: the pinned experts, then the prefill."""
        return self.pinned + self.prefill

    @property
    def experts(self) -> int:
        return len(self._home)

    def count(self, home: str) -> int:
        return len({CARD: self.pinned, HOST: self.host, DISK: self.disk}[home])

    def line(self) -> str:
        """One log line: where the experts live and what the slots start with."""
        return (f"placement: {len(self.pinned)} experts pinned on card, {len(self.host)} in host pool, "
                f"{len(self.disk)} on disk; {len(self.prefill)} cache slots pre-filled")


def place(experts: Sequence[Key], *, pinned: int, host: int, disk: int, slots: int,
          ranking: Iterable[Key] | None = None) -> Placement:
    """The placement of `experts` (every routed (layer, expert), in file order).

    pinned + host + disk must equal len(experts) and slots must be at least
    pinned (the receipt guarantees both). Raises ValueError on counts that do
    not add up, a repeated expert, or a ranking that names an expert twice or
    one not in `experts`.
    """
    experts = [tuple(k) for k in experts]
    listed: set[Key] = set()
    for k in experts:
        if k in listed:
            raise ValueError(f"expert (layer {k[0]}, expert {k[1]}) is listed twice")
        listed.add(k)
    for name, n in (("pinned", pinned), ("host", host), ("disk", disk), ("slots", slots)):
        if n < 0:
            raise ValueError(f"{name} = {n}: a count cannot be negative")
    if pinned + host + disk != len(experts):
        raise ValueError(f"{pinned} pinned + {host} host + {disk} disk = {pinned + host + disk}, "
                         f"but the model has {len(experts)} routed experts")
    if slots < pinned:
        raise ValueError(f"{slots} slots cannot hold the {pinned} pinned experts")

    order = rank_order(experts, ranking)
    card_keys = order[:pinned]
    host_set = set(order[pinned:pinned + host])
    prefill = tuple(order[pinned:pinned + min(slots - pinned, len(order) - pinned)])
    host_keys = tuple(k for k in experts if k in host_set)  # file order
    disk_set = set(order[pinned + host:])
    disk_keys = tuple(k for k in experts if k in disk_set)
    home = {k: CARD for k in card_keys}
    home.update((k, HOST) for k in host_keys)
    home.update((k, DISK) for k in disk_keys)
    return Placement(tuple(card_keys), host_keys, disk_keys, prefill, home,
                     {k: i for i, k in enumerate(host_keys)})


def place_receipt(receipt, experts: Sequence[Key], ranking: Iterable[Key] | None = None) -> Placement:
    """`place` with the counts of a `receipt.Receipt` (or anything with its fields)."""
    return place(experts, pinned=receipt.experts_pinned, host=receipt.experts_host,
                 disk=receipt.experts_disk, slots=receipt.expert_slots, ranking=ranking)


def rank_order(experts: Sequence[Key], ranking: Iterable[Key] | None) -> list[Key]:
    """Every expert once: the ranked ones first (in ranking order), then the rest in file order."""
    known = set(experts)
    order: list[Key] = []
    seen: set[Key] = set()
    for k in ranking or ():
        k = tuple(k)
        if k not in known:
            raise ValueError(f"the ranking names expert (layer {k[0]}, expert {k[1]}), which the model does not "
                             f"have (was the profile made for another model?)")
        if k in seen:
            raise ValueError(f"the ranking names expert (layer {k[0]}, expert {k[1]}) twice")
        seen.add(k)
        order.append(k)
    order += [k for k in experts if k not in seen]
    return order


def routed_experts(header) -> list[Key]:
    """The decoder's routed experts of a `.rad` header in file order (the MTP head's excluded,
    as in the budget's count): `.experts` (.layer .expert .offset), `.model.num_hidden_layers`."""
    layers = header.model.num_hidden_layers
    return [(e.layer, e.expert) for e in sorted(header.experts, key=lambda e: e.offset) if e.layer < layers]
