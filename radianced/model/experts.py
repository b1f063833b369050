"""How a MoE layer reaches routed-expert weights: the `ExpertSource` seam.

The model never holds expert weights. It asks an `ExpertSource` for a layer's
table (the seed of the device pointer table): `table(layer)[e]` is the row of
expert e in `slab`, where each row is one expert extent laid out as in the
`.rad` file: gate [I, H] | up [I, H] | down [H, I] (for a compact format, the
extent's bytes: three compact pieces with their scales). The tiers package
implements the source with slots, a host pool and a disk tier; `ResidentExperts`
here keeps every expert in one slab (the CPU and `--placement resident`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from radianced.kernels.formats import is_compact


class ExpertSource(Protocol):
    slab: torch.Tensor  # [rows, 3 * I * H]: VRAM slots
    host: torch.Tensor | None  # [rows, 3 * I * H]: the host pool, read over the link (negative table entries)
    # uint8 [R, W] on the card: rows a MoE call may copy its routed host experts into before reading them
    # (GGUF experts: kernels/stage.py), or None
    staging: torch.Tensor | None
    # Whether `prepare` makes routed experts addressable (reads them in: a host sync). Then the MoE
    # calls it with a layer's ids before that layer's experts are read; otherwise once the launches
    # that route and read them are queued (one launch fewer at T == 1, kernels/moe.py `route_moe`).
    stages_experts: bool

    def weight_format(self, layer: int) -> str | None:
        """The format of `layer`'s extents when the slab (and host) are uint8 rows of compact
        extents (`formats.expert_formats` reads it; the MoE ops dequantize them); None when they
        hold the weights in the activations' dtype."""
        ...

    def table(self, layer: int) -> torch.Tensor:
        """[E] int64: where each expert of `layer` is: slab row (>= 0) or host row -1 - entry (< 0).
        Contents may change between steps."""
        ...

    def prepare(self, layer: int, expert_ids: torch.Tensor) -> None:
        """Called once per layer call with its routing ([T, k] int64 ids, on the slab's device).

        With `stages_experts`: before the experts are read, and returns once the table rows of
        those experts point at readable weights. Without: after the launches that compute the ids
        and read the experts are queued; the ids are ready in stream order (a host read waits for
        them: keep the tensor and read it after the step, as tiers/slab.py does, to stay sync-free).
        """
        ...


class ResidentExperts:
    """Every routed expert in one slab; the table maps (layer, expert) to its fixed row.

    A `.rad` with compact experts (`kernels/formats.py`) gets a uint8 slab [rows, widest
    extent's bytes rounded up to 16: the Triton MoE's aligned rows], each extent copied as the
    file holds it, and `weight_format(layer)`
    names the format of that layer's extents (formats may differ by layer: a GGUF stores
    each layer's expert stacks in its own type); the reference MoE dequantizes an expert
    when it runs. Otherwise the slab holds the weights in their dtype and no format is named.
    """

    host = staging = None  # every expert has a slot
    stages_experts = False

    def __init__(self, slab: torch.Tensor, tables: dict[int, torch.Tensor], formats: dict[int, str] | None = None):
        self.slab = slab
        self._tables = tables
        self._formats = formats or {}

    @classmethod
    def from_rad(cls, rad, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                 layers: range | None = None, owned: tuple[int, int] | None = None) -> ResidentExperts:
        """Copy every expert extent of `layers` of a `.rad` (default: the decoder layers', not the MTP
        head's) (checksums verified) into one slab, layer-major; compact extents stay compact (`dtype`
        then does not apply). owned: (first, stop), a `--tp` card's expert ids: only those are copied,
        and each layer's table keeps all E entries, another card's expert pointing at the card's first
        one (the MoE routes those assignments there at weight 0: model/layers.py)."""
        layers = range(rad.model.num_hidden_layers) if layers is None else layers
        first, stop = owned or (0, rad.model.num_experts)
        entries = sorted((e for e in rad.header.experts if e.layer in layers and first <= e.expert < stop),
                         key=lambda e: (e.layer, e.expert))
        if not any(is_compact(e.dtype) for e in entries):
            slab = cls._build([(e.layer, e.expert - first, rad.expert(e.layer, e.expert, verify=True))
                               for e in entries], device, dtype).slab
            formats = {}
        else:
            width = (max(e.nbytes for e in entries) + 15) // 16 * 16
            slab = torch.zeros((len(entries), width), dtype=torch.uint8, device=device)
            for row, e in enumerate(entries):
                slab[row, :e.nbytes] = rad.expert_bytes(e.layer, e.expert, verify=True)
            formats = {e.layer: e.dtype for e in entries}
        per_layer = stop - first  # a layer's rows, in id order
        tables = {}
        for i, layer in enumerate(sorted({e.layer for e in entries})):
            table = torch.full((rad.model.num_experts,), i * per_layer, dtype=torch.int64)
            table[first:stop] = torch.arange(i * per_layer, (i + 1) * per_layer)
            tables[layer] = table.to(slab.device)
        return cls(slab, tables, formats)

    def weight_format(self, layer: int) -> str | None:
        return self._formats.get(layer)

    @classmethod
    def from_weights(cls, layers: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                     device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> ResidentExperts:
        """From stacked per-layer weights: gate [E, I, H], up [E, I, H], down [E, H, I]."""
        return cls._build([(layer, e, (g[e], u[e], d[e]))
                           for layer, (g, u, d) in sorted(layers.items()) for e in range(g.shape[0])],
                          device, dtype)

    @classmethod
    def _build(cls, experts, device, dtype) -> ResidentExperts:
        """experts: (layer, expert, (gate, up, down)) in layer-major order."""
        experts = list(experts)
        gate0 = experts[0][2][0]
        slab = torch.empty((len(experts), 3 * gate0.numel()), dtype=dtype or gate0.dtype, device=device)
        tables: dict[int, list[int]] = {}
        for row, (layer, expert, (gate, up, down)) in enumerate(experts):
            slab[row] = torch.cat((gate.flatten(), up.flatten(), down.flatten()))
            table = tables.setdefault(layer, [])
            assert expert == len(table), "experts must come in order within a layer"
            table.append(row)
        return cls(slab, {layer: torch.tensor(r, dtype=torch.int64, device=slab.device) for layer, r in tables.items()})

    def table(self, layer: int) -> torch.Tensor:
        return self._tables[layer]

    def prepare(self, layer: int, expert_ids: torch.Tensor) -> None:
        """Resident experts are always addressable."""
