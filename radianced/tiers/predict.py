"""The expert tiers' steady state as arithmetic: hit rate, overflow bytes per token, tok/s bounds.

`predict(profile, placement, ...)` reads the expert profile (routing counts per
(layer, expert)) as the traffic's distribution and the receipt's placement as
where every expert sits, and returns a `Prediction` of decode at B tokens a
step (one per sequence): the lookups a step makes, how many find their expert
in a card slot, and how many read it from the host pool over PCIe or from the
model file. `radiancectl plan` prints it after the receipt (`plan_lines`).

The model of the slot policy. The daemon fills the slots at start with the
profile's top-ranked experts (`placement.place`: pinned, then the pre-fill in
rank order), and `SlotPolicy` replaces a cached expert only with a missed one
routed at least 1.5 times lately and 1.5 times hotter than the coldest cached
one. Under traffic drawn from the profile's distribution the start slots are
already the most frequent experts, so the steady state is modelled as those
slots kept: the top-S by profile count, S the receipt's start slots (pinned
included). With --deterministic every slot is pinned and nothing is swapped:
there the model is the policy. Three things it leaves out. The decayed counts
follow a stretch of traffic hotter in some experts than the whole profile, and
the policy swaps them in and hits more than predicted. The profile counts the
prompt tokens too, which decode does not route: profile decode-like traffic
(short prompts, long outputs) to predict decode. And in lending mode KV takes
slots back as contexts grow (down to the receipt's expert floor), and then it
hits less. The measured side (`radiance_expert_*` metrics) counts what this
counts. On the tiny MoE served greedy (tests/tiers/test_predict.py: 8 of 48
slots, 4 prompts of 64 tokens) b1 predicted 43.8%; the start slots' share of
the decode routing alone was 44.8%, and measured 53.9% after 21 swaps (a random
model's greedy decode cycles through a few tokens: much locality). At b4 it
predicted 17.3 lookups a step and a 36.0% hit rate; measured 18.6 and 34.6%.

Per (layer l, expert e) the profile gives p = count / tokens_l, the share of a
layer's tokens routed to e (tokens_l = the layer's assignments / top-k). A
lookup is one (step, layer, distinct expert routed), as the slab counts them
(routing.py). With B tokens routed independently, expert e is looked up in a
step with probability 1 - (1 - p)^B, so by linearity the expected lookups are
the sum of that over all experts, and the hits its sum over the slotted ones:
exact given the marginals and independent tokens (the joint of a token's top-k
set is not needed). At B = 1 this is p: the hit rate is the slotted experts'
share of the profile's assignments. A missed lookup moves one extent (the
receipt's widest, as the overflow metric counts it).

The tok/s bounds are times per step, summed: the overflow bytes over the link
(PCIe, probed or given), disk-homed misses also read from disk first, and the
card's bytes read from HBM (resident weights but the embedding table, which a
step gathers a row of, plus the hit experts). `ceiling` is the overflow alone:
the link's time, or the disk's where that is longer. KV, activations and launch
time are not counted: both are bounds. `from_resident` is a prediction, not a
bound: a decode step measured where every expert hits (the same model and
batch on a card that holds them all) stands for all that the bounds leave out,
and the misses trade their HBM reads for the link's (`tok_s_from_resident`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from radianced.tiers.placement import Placement
from radianced.tiers.profile import Profile

GB = 1e9  # link rates are in 1e9 bytes per second, as the probes report them
MiB = 1 << 20


@dataclass(frozen=True)
class Prediction:
    """Decode at steady state, per step of `batch` tokens (expected values: floats).

    batch: decode tokens a step, one per sequence (B).
    slots: experts in a card slot at steady state: the start slots (pinned included).
    lookups: expected lookups a step: distinct (MoE layer, expert) its tokens route to.
    hits: expected lookups a step that find their expert in a slot.
    host_misses: expected missed lookups a step whose home is the host pool (read over PCIe).
    disk_misses: expected missed lookups a step whose home is the model file (read from disk,
        then over PCIe).
    extent_bytes: bytes one missed lookup moves (the receipt's widest extent, as the
        `radiance_expert_overflow_bytes` metric counts it).
    resident_bytes: card-resident weights a step reads besides the experts (the receipt's
        weights on the card less an embedding table).
    profile_tokens: tokens the profile counted (its first MoE layer's assignments / top-k).
    """

    batch: int
    slots: int
    lookups: float
    hits: float
    host_misses: float
    disk_misses: float
    extent_bytes: int
    resident_bytes: int
    profile_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 1.0

    @property
    def overflow_bytes_per_token(self) -> float:
        """Expert bytes a generated token reads over the link (both tiers' misses)."""
        return (self.host_misses + self.disk_misses) * self.extent_bytes / self.batch

    @property
    def disk_bytes_per_token(self) -> float:
        """... of which first read from the model file."""
        return self.disk_misses * self.extent_bytes / self.batch

    @property
    def hbm_bytes_per_token(self) -> float:
        """Card bytes a generated token reads: the resident weights (once a step) and the hits."""
        return (self.resident_bytes + self.hits * self.extent_bytes) / self.batch

    def ceiling(self, link_gbps: float, disk_gbps: float | None = None) -> float:
        """Tok/s the overflow allows: the link's rate over its bytes per token, or the disk's over
        its own where that is slower (given a disk rate); inf: no overflow."""
        seconds = self.overflow_bytes_per_token / (link_gbps * GB)
        if disk_gbps:
            seconds = max(seconds, self.disk_bytes_per_token / (disk_gbps * GB))
        return 1 / seconds if seconds else float("inf")

    def serial(self, link_gbps: float, hbm_gbps: float, disk_gbps: float | None = None) -> float:
        """Tok/s with the times of the link, the disk (when given) and HBM added up, no overlap."""
        seconds = self.overflow_bytes_per_token / (link_gbps * GB) + self.hbm_bytes_per_token / (hbm_gbps * GB)
        if disk_gbps:
            seconds += self.disk_bytes_per_token / (disk_gbps * GB)
        return 1 / seconds

    def from_resident(self, resident_step_s: float, link_gbps: float, hbm_gbps: float) -> float:
        """Tok/s from `resident_step_s`, a decode step of `batch` tokens measured where every expert hits
        (module docstring); disk misses count at the link's rate."""
        return tok_s_from_resident(self.batch, self.overflow_bytes_per_token, resident_step_s, link_gbps, hbm_gbps)


def tok_s_from_resident(batch: int, overflow_bytes_per_token: float, resident_step_s: float, link_gbps: float,
                        hbm_gbps: float) -> float:
    """Tok/s of `batch` sequences when the expert bytes a step misses (`overflow_bytes_per_token` a token),
    which an all-hit step of `resident_step_s` read from HBM, cross the link instead: their HBM time out,
    their link time in (no overlap)."""
    missed = overflow_bytes_per_token * batch
    return batch / (resident_step_s - missed / (hbm_gbps * GB) + missed / (link_gbps * GB))


def link_gbps_from_resident(batch: int, overflow_bytes_per_token: float, resident_step_s: float, step_s: float,
                            hbm_gbps: float) -> float | None:
    """`tok_s_from_resident` solved for the link: the rate (GB/s) at which a measured step of `step_s` moved its
    misses, if all the rest of it was the all-hit step's; None where it missed nothing or took no longer than
    the all-hit step less its misses' HBM time (the model does not describe that step)."""
    missed = overflow_bytes_per_token * batch
    on_link = step_s - resident_step_s + missed / (hbm_gbps * GB)
    return missed / on_link / GB if missed > 0 and on_link > 0 else None


def predict(profile: Profile, placement: Placement, *, top_k: int, extent_bytes: int, resident_bytes: int = 0,
            batch: int = 1) -> Prediction:
    """The steady state of decode at `batch` tokens a step (module docstring: the model).

    `placement` must place the profile's experts (the model's MoE layers x experts); `top_k`
    is the model's experts per token. Raises ValueError on a batch below 1, a placement of
    another shape, or a profile layer with no tokens counted.
    """
    if batch < 1:
        raise ValueError(f"batch {batch}: a decode step has at least one token")
    counts = _counts(profile)
    p = _shares(counts, profile.moe_layers, top_k)  # [L, E]
    looked = 1 - (1 - p) ** batch  # P(expert looked up in a step)
    pos = {layer: i for i, layer in enumerate(profile.moe_layers)}
    layers = {layer for layer, _ in placement.pinned + placement.host + placement.disk}
    if placement.experts != p.size or layers != set(pos):
        raise ValueError(f"the placement has {placement.experts} experts in layers {sorted(layers)}, the profile "
                         f"MoE layers {list(pos)} x {profile.num_experts} experts: not the same model")
    slotted, host, disk = (np.zeros(p.shape, dtype=bool) for _ in range(3))
    for where, keys in ((slotted, placement.slots), (host, placement.host), (disk, placement.disk)):
        for layer, expert in keys:
            where[pos[layer], expert] = True
    missed = looked * ~slotted
    return Prediction(batch=batch, slots=len(placement.slots), lookups=float(looked.sum()),
                      hits=float(looked[slotted].sum()), host_misses=float(missed[host].sum()),
                      disk_misses=float(missed[disk].sum()), extent_bytes=extent_bytes,
                      resident_bytes=resident_bytes, profile_tokens=round(counts[0].sum() / top_k))


def routing_shares(profile: Profile, top_k: int) -> np.ndarray:
    """[MoE layer, expert]: the share of the layer's profiled tokens routed to each expert."""
    return _shares(_counts(profile), profile.moe_layers, top_k)


def _counts(profile: Profile) -> np.ndarray:
    """[MoE layer, expert]: the profile's assignments."""
    return np.array([[profile.count(layer, e) for e in range(profile.num_experts)] for layer in profile.moe_layers],
                    dtype=np.float64)


def _shares(counts: np.ndarray, layers, top_k: int) -> np.ndarray:
    """counts over each layer's tokens (its assignments / top-k); ValueError for a layer with none."""
    tokens = counts.sum(axis=1) / top_k
    for layer, n in zip(layers, tokens.tolist()):
        if n <= 0:
            raise ValueError(f"the profile counted no tokens at MoE layer {layer}: re-run radiancectl profile")
    return counts / tokens[:, None]


# -- radiancectl plan's block ----------------------------------------------------


def predictions(rad, receipt, profile: Profile) -> list[Prediction]:
    """Decode at batch 1 and at the receipt's --max-num-seqs with `profile`'s traffic and the receipt's
    placement of `rad`'s experts (the start slots filled in the profile's rank order, as start-up fills them)."""
    from radianced.tiers.placement import place_receipt, routed_experts

    placement = place_receipt(receipt, routed_experts(rad.header), ranking=profile.rank())
    resident = sum(p.bytes for p in receipt.weights if p.name != "embeddings")
    return [predict(profile, placement, top_k=rad.model.num_experts_per_tok, extent_bytes=receipt.expert_extent,
                    resident_bytes=resident, batch=batch) for batch in sorted({1, receipt.max_num_seqs})]


def plan_lines(rad, receipt, *, pcie_gbps: float | None = None, hbm_gbps: float | None = None,
               resident_steps: dict[int, float] | None = None) -> list[str]:
    """The "predicted" block `radiancectl plan` prints after the receipt of `rad` (a `RadFile`; its
    header is all that is read, and the profile beside it): `predictions`. The link rate is `pcie_gbps`,
    else probed when CUDA is there (as start-up probes it), else the tok/s lines say to give one.
    `resident_steps`: batch -> seconds of a decode step measured where every expert hits, for
    `Prediction.from_resident` (with `hbm_gbps`). Empty for a dense model. Raises ProfileError for a
    profile that does not belong to the model."""
    from radianced.tiers.profile import profile_path

    if not receipt.experts:
        return []
    path = profile_path(rad.path)
    if not path.exists():
        return [f"predicted: no expert profile ({path.name}) beside the model: run radiancectl profile MODEL "
                f"--prompts FILE to predict the hit rate, overflow and tok/s"]
    profile = Profile.load_for(rad, path)
    preds = predictions(rad, receipt, profile)
    homed_off_card = receipt.experts_host or receipt.experts_disk
    link, where = _link_rate(pcie_gbps) if homed_off_card else (None, "")  # none: all on the card
    disk = _disk_rate(rad.path) if receipt.experts_disk and link else None
    out = [f"predicted ({profile.line(path)}, {preds[0].profile_tokens} tokens; steady state: the "
           f"{preds[0].slots} start slots hold the profile's top-ranked experts):"]
    for pr in preds:
        out += [f"  decode b{pr.batch}: hit rate {100 * pr.hit_rate:.1f}% ({pr.hits:.2f} of {pr.lookups:.2f} lookups "
                f"a step); overflow {_mib(pr.overflow_bytes_per_token)} a token ({_mib(pr.disk_bytes_per_token)} "
                f"of it from disk)", "    " + _tok_s(pr, link, where, hbm_gbps, disk)]
        step = (resident_steps or {}).get(pr.batch)
        if step is not None:
            out.append("    " + _from_resident(pr, step, link, hbm_gbps))
    return out


def resident_step(text: str) -> tuple[int, float]:
    """An argparse type: B=MS, a decode step of B sequences measured where every expert hits, in ms."""
    import argparse

    batch, _, ms = text.partition("=")
    try:
        pair = int(batch), float(ms) / 1e3
    except ValueError:
        pair = None
    if pair is None or pair[0] < 1 or not 0 < pair[1] < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give BATCH=MS, e.g. 1=6.4 (a batch of 1 or more, a step in "
                                         f"ms above 0)")
    return pair


def gbps(text: str) -> float:
    """An argparse type: a rate in GB/s, above 0 (the flag's error names the value and the unit)."""
    import argparse

    try:
        rate = float(text)
    except ValueError:
        rate = None
    if rate is None or not 0 < rate < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give the rate in GB/s (1e9 bytes a second), a number above 0")
    return rate


def _tok_s(pr: Prediction, link: float | None, where: str, hbm_gbps: float | None, disk: float | None) -> str:
    """One prediction's tok/s line: the batch's sequences together."""
    label = "tok/s" if pr.batch == 1 else f"tok/s of the {pr.batch} together"
    if not pr.overflow_bytes_per_token:
        text, link = f"{label}: no overflow, the link does not bound it", float("inf")
    elif link is None:
        return f"{label}: needs a link rate: {where}"
    else:
        disk_text = ""
        if pr.disk_misses:
            disk_text = (f", {disk:.2f} GB/s disk (probed)" if disk else
                         " (the disk left out: the model file could not be probed with O_DIRECT)")
        text = f"{label}: at most {pr.ceiling(link, disk):,.1f} at {link:.1f} GB/s PCIe ({where}){disk_text}"
    if hbm_gbps is None:
        return text + "; give --hbm-gbps for the bound with the card's reads added"
    return (text + f"; {pr.serial(link, hbm_gbps, disk):,.1f} with {_mib(pr.hbm_bytes_per_token)} a token at "
            f"{hbm_gbps:g} GB/s HBM added")


def _from_resident(pr: Prediction, step_s: float, link: float | None, hbm_gbps: float | None) -> str:
    """The tok/s line from a measured all-hit step (`Prediction.from_resident`)."""
    said = f"from the all-hit step ({1e3 * step_s:g} ms at b{pr.batch})"
    if pr.overflow_bytes_per_token and not (link and hbm_gbps):
        return f"{said}: needs a link rate and --hbm-gbps (its misses' bytes move from HBM to the link)"
    rate = pr.from_resident(step_s, link or 1.0, hbm_gbps or 1.0)  # no overflow: the rates do not enter
    return f"{said}: {rate:,.1f} tok/s, its misses' bytes moved from HBM to the link"


def _link_rate(pcie_gbps: float | None) -> tuple[float | None, str]:
    """(GB/s, where it came from): the flag, else the start-up probe on CUDA, else (None, what to do)."""
    if pcie_gbps is not None:
        return pcie_gbps, "--pcie-gbps"
    import torch

    if not torch.cuda.is_available():
        return None, "give --pcie-gbps (no CUDA here to probe the link)"
    from radianced.tiers.link import probe_pcie

    return probe_pcie().gb_per_s, "probed"


def _disk_rate(path) -> float | None:
    """The disk tier's O_DIRECT read rate of the model file, as start-up probes it; None where
    the file cannot be read that way (then the disk's time is left out of the sum)."""
    from radianced.tiers.link import probe_disk

    try:
        return probe_disk(path).gb_per_s
    except OSError:
        return None


def _mib(n: float) -> str:
    return f"{n / MiB:.3f} MiB"
