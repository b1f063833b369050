"""The expert tiers a receipt describes, built: placement, host pool, probes, loader and slab.

`build_expert_slab` is `Engine.build`'s one call for a model with routed
experts. It reads the expert profile beside the model (if any) for the fill
order, places every expert where the receipt says (card slots, host pool, or
the file with the disk tier), fills the host pool, measures the links the
placement will use (PCIe for overflow and disk reads, O_DIRECT for the disk
tier), and leases and fills the slab's start slots (one checked against the
file: `fill_line`). Its start-up lines go to the engine's log, after the
receipt's.

Under `--tp N` each card builds its own from its receipt over its share of the
experts (`owned`: a range of ids in every layer): its slots, its host pool and
its reads of the file, as one card does over all of them (engine/tp_memory.py).

Compact experts (`kernels/formats.py`) stay compact in every tier: slots, host
pool rows and disk reads hold the extent's bytes as the file does (a uint8 slab
as wide as the receipt's extent), and the slab names each layer's format
(`weight_format`) for the MoE op to dequantize.
"""

from __future__ import annotations

import logging

import torch
import xxhash

from radianced.arena import Arena
from radianced.budget import Receipt
from radianced.config import Config
from radianced.kernels.formats import is_compact
from radianced.model.rad import RadFile
from radianced.tiers.disk import DiskReader
from radianced.tiers.expert_loader import ExpertLoader
from radianced.tiers.host import HostPool
from radianced.tiers.link import probe_disk, probe_pcie
from radianced.tiers.placement import Key, place_receipt, routed_experts
from radianced.tiers.profile import Profile, ProfileError, profile_path
from radianced.tiers.slab import ExpertSlab, SlabError

log = logging.getLogger("radianced.engine")  # Engine.build's start-up lines, one logger for all of them


def build_expert_slab(rad: RadFile, arena: Arena, receipt: Receipt, dtype: torch.dtype, cfg: Config,
                      resources: list, owned: tuple[int, int] | None = None) -> ExpertSlab:
    """The placement the receipt implies: pinned experts and a pre-filled cache in arena
    slots, the rest in the host pool (O_DIRECT-filled, checksums verified) read over the link,
    or with the disk tier in the file, read when a step routes them. With
    `<model>.expert-profile.bin` beside the model, slots are filled in its rank order.
    With `--host-pool-placement ram=DIR` the pool is a file in that tmpfs, shared by daemons.
    Appends the host pool and the expert loader to `resources` (the engine closes them).
    owned: (first, stop), a card's expert ids under --tp (its receipt counts only those)."""
    ranking, experts = _profile_ranking(rad), routed_experts(rad.header)
    if owned is not None:
        def mine(keys: list[Key]) -> list[Key]:
            return [k for k in keys if owned[0] <= k[1] < owned[1]]
        experts, ranking = mine(experts), None if ranking is None else mine(ranking)
    placement = place_receipt(receipt, experts, ranking=ranking)
    log.info("experts: %s", placement.line())
    host = None
    if placement.host:
        pool = HostPool.create(rad, placement.host, row_bytes=receipt.page_bytes, capacity_bytes=receipt.host_pool,
                               ram_dir=cfg.host_pool_ram_dir)
        resources.append(pool)
        log.info(pool.line())
        host = pool.tensor  # (a view of it, below, keeps the pool's memory alive)
    if placement.host or placement.disk:  # what overflow and disk reads will cost: measured, not assumed
        log.info(probe_pcie().line())
    if placement.disk:
        log.info(probe_disk(rad.path).line())
    dtype, formats = _rows(rad, dtype)
    width = receipt.expert_extent // dtype.itemsize
    host = None if host is None else host[:, :width]
    loader = ExpertLoader(DiskReader.from_rad(rad), arena.paged_view(dtype, (width,)), receipt.expert_extent,
                          receipt.staging_rows)
    resources.append(loader)
    if placement.disk:
        log.info("disk tier: %d experts stay in %s, read with O_DIRECT when a step routes them "
                 "(buffers: 2 x %d slots)", len(placement.disk), rad.path, len(arena.reserved) // 2)
    slab = ExpertSlab(arena, width, dtype, placement, host, loader, rad.model.num_experts, cfg.expert_slots,
                      formats, owned, receipt.miss_staging[0])
    log.info(fill_line(slab, ranked=ranking is not None))
    return slab


def fill_line(slab: ExpertSlab, ranked: bool) -> str:
    """The start-up line: slots pre-filled, how fast, and one slot checked against the file."""
    pages = slab.slot_pages()
    n = len(pages)
    mb = n * slab.extent_bytes / 1e6
    rate = mb / slab.fill_seconds if slab.fill_seconds > 0 else float("inf")
    order = "from the profile" if ranked else "in file order"
    checked = ""
    if n and slab.loader is not None:
        verify_slot(slab, min(pages.values()))
        checked = f"; slot {min(pages.values())} verified"
    return f"pre-filled {n} slots {order} in {slab.fill_seconds:.2f} s ({rate:.0f} MB/s){checked}"


def verify_slot(slab: ExpertSlab, slot: int) -> Key:
    """Check slot `slot`'s bytes against the file's checksum of the expert it holds (a copy to the host);
    returns that expert. Raises SlabError on a mismatch."""
    key = next(k for k, p in slab.slot_pages().items() if p == slot)
    extent = slab.loader.reader.extents[key]
    data = slab.slab[slot].view(torch.uint8)[:extent.nbytes].cpu().numpy()  # rows fit the widest extent
    if xxhash.xxh3_64_intdigest(data) != extent.checksum:
        raise SlabError(f"slot {slot} (layer {key[0]}, expert {key[1]}) does not match the model file's "
                        f"checksum after the start fill: the card's memory or the copy is faulty")
    return key


def _rows(rad: RadFile, dtype: torch.dtype) -> tuple[torch.dtype, dict[int, str]]:
    """(the slab's dtype, the format of each layer's extents for `weight_format`): `dtype` and none
    for plain experts; uint8 and every layer's format when any extent is compact (byte rows:
    layers may differ in format and extent size, a row holds the widest)."""
    if not any(is_compact(e.dtype) for e in rad.header.experts):
        return dtype, {}
    return torch.uint8, {e.layer: e.dtype for e in rad.header.experts}


def _profile_ranking(rad: RadFile) -> list[Key] | None:
    """The (layer, expert) ranking of the model's expert profile, or None without a usable one
    (a stale or corrupt profile is logged with what to do, and start-up goes on in file order)."""
    path = profile_path(rad.path)
    if not path.exists():
        return None
    try:
        profile = Profile.load_for(rad, path)
    except ProfileError as e:
        log.warning("%s; slots are filled in file order", e)
        return None
    log.info(profile.line(path))
    return profile.rank()
