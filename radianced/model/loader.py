"""Open a `.rad` and build its family's model, every weight where the receipt puts it.

The model is built over the file's zero-copy host views first and placed after, one
tensor at a time: a tensor the model derives from several stored ones (Attention's
[q | k | v]) is joined on the host and crosses to the device once, so the card never
holds a transient copy. Which tensors go where is `load_plan`'s, the same rule the
budget charges (charges.py): all of them on the compute device, except the token
embedding table under `--embedding-placement ram` on a GPU, which stays in host RAM,
pinned, and is read row by row inside the step (kernels/embedding.py) — unless the
lm_head is tied to it: its one copy is then on the card, where the lm_head reads it.

The price of joining on the host: every layer's [q | k | v] is a host copy until it is
placed, e.g. Qwen3-30B-A3B's 48 x 20 MiB = 960 MiB of RAM for the length of the load
(the file's own views cost no RAM beyond the page cache).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radianced.kernels.compact import CompactWeight, RowStack
from radianced.kernels.formats import COMPACT_TILES, CPU_BLOCKS, FORMATS, expert_formats
from radianced.kernels.pinned import PinError, register_pinned
from radianced.model.config import ModelConfig
from radianced.model.experts import ExpertSource, ResidentExperts
from radianced.model.layers import CausalLM, Weights
from radianced.model.llama import build_llama
from radianced.model.parallel import SINGLE, Group
from radianced.model.qwen3_moe import build_qwen3_moe
from radianced.model.qwen3_next import build_qwen3_next
from radianced.model.rad_format import RadError

if TYPE_CHECKING:
    from radianced.model.rad import RadFile

EMBEDDINGS = "model.embed_tokens.weight"
# Objects of these modules are walked for tensors to place; anything else the model holds (the
# expert source, its config) is left as it is: the expert slab is placed by whoever built it.
_UNWALKED = ("radianced.model.experts", "radianced.model.config")

@dataclass(frozen=True)
class LoadPlan:
    """Where `load_model` puts the stored tensors the model reads (names, in the order it reads them).

    device: copied to the compute device.
    host: kept in host RAM, pinned: the embedding table under `--embedding-placement ram` on a
        GPU when the lm_head is not tied to it; () otherwise.
    """

    device: tuple[str, ...]
    host: tuple[str, ...]


@dataclass(frozen=True)
class Placed:
    """What `load_model` put where, in bytes as placed (after any `dtype` cast).

    device_bytes: weights copied to the compute device (0 on the CPU, where nothing moves).
    host_bytes: weights pinned in host RAM for the device to read (the embedding table or 0).
    """

    device_bytes: int
    host_bytes: int


def build_model(cfg: ModelConfig, weights: Weights, experts: ExpertSource | None = None, mtp: bool = False,
                mtp_experts: ExpertSource | None = None, group: Group = SINGLE) -> CausalLM:
    """The family's model over a `Weights` getter (name -> tensor) and, for MoE families, an expert source;
    with `mtp`, its MTP head too (`model.mtp`; its routed experts from `mtp_experts`). Over a `group`:
    this rank's share (cfg the card's, `weights` its slices: model/sharded_loader.py)."""
    if mtp and not cfg.num_mtp_layers:
        raise RadError(f"this {cfg.family} model has no MTP layers: draft with --speculative-method ngram")
    if cfg.family == "llama":
        return build_llama(cfg, weights, group)
    if cfg.family == "qwen3_moe":
        return build_qwen3_moe(cfg, weights, experts, group)
    if cfg.family == "qwen3_next":
        return build_qwen3_next(cfg, weights, experts, mtp, mtp_experts, group)
    raise ValueError(f"family {cfg.family!r} has no model")


def activation_dtype(rad: RadFile) -> torch.dtype:
    """The dtype a `.rad`'s model computes in (and its KV cache holds): its embeddings', or its final
    norm's when the embeddings are compact (`CausalLM` gathers compact rows into that dtype)."""
    embed = rad.tensor(EMBEDDINGS, verify=False)
    return embed.dtype if isinstance(embed, torch.Tensor) else rad.tensor("model.norm.weight", verify=False).dtype


def _embeddings_on_host(cfg: ModelConfig, embedding_placement: str, device: torch.device | str) -> bool:
    """Whether the table stays in host RAM: `ram` on a device other than the CPU (where host RAM is the
    device's memory), and no lm_head tied to it."""
    return embedding_placement == "ram" and torch.device(device).type != "cpu" and not cfg.tie_word_embeddings


def load_plan(rad: RadFile, embedding_placement: str = "vram", device: torch.device | str = "cuda",
              mtp: bool = False) -> LoadPlan:
    """The plan `load_model(rad, device, embedding_placement=..., mtp=...)` follows, found without a device:
    the family's model is built over shape-only (meta) views and every name it reads is recorded."""
    names: list[str] = []

    def read(name: str) -> torch.Tensor | CompactWeight:
        names.append(name)
        return rad.tensor(name, verify=False).to("meta")

    build_model(rad.model, read, mtp=mtp)  # MoE blocks only keep the expert source: None is never read here
    host = _embeddings_on_host(rad.model, embedding_placement, device)
    return LoadPlan(tuple(n for n in names if not (host and n == EMBEDDINGS)),
                    (EMBEDDINGS,) if host and EMBEDDINGS in names else ())


def load_model(rad: RadFile, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
               experts: ExpertSource | None = None, embedding_placement: str = "vram", mtp: bool = False) -> CausalLM:
    """The model of a `.rad`; every tensor checksum-verified as it is loaded, cast to `dtype` if given,
    and placed as `load_plan` says (`model.placed` says how many bytes went where). `mtp`: with the MTP
    head, its routed experts resident (the budget's "mtp" class).

    A MoE model without an `experts` source gets every expert resident. Compact tensors stay
    compact (`CompactWeight`: `dtype` does not apply to them) in the form the device's kernels
    read (`device_weights`); on the CPU a compact lm_head in a format the block kernels do not read
    (`dense_lm_head`) is made dense once, as the lm_head is read whole every step.
    Off the CPU the Triton kernels read them (kernels/moe.py for experts, kernels/linear.py for
    layers); a format they do not read is refused (`refuse_unread_formats`).
    """
    refuse_unread_formats(rad, device)
    if experts is None and rad.header.experts:
        experts = ResidentExperts.from_rad(rad, device, dtype)
    mtp_experts = None
    if mtp and rad.header.experts and rad.model.num_mtp_layers:  # build_model refuses a model without
        first = rad.model.num_hidden_layers
        mtp_experts = ResidentExperts.from_rad(rad, device, dtype, range(first, first + 1))
    model = build_model(rad.model, device_weights(rad, device, dtype), experts, mtp, mtp_experts)
    if torch.device(device).type == "cpu":
        dense_lm_head(model)
        model.placed = Placed(0, 0)
        return model
    host_table = model.embed.weight if load_plan(rad, embedding_placement, device, mtp).host else None
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(host tensor) -> (it, its placed copy)

    def place(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in moved:  # a tensor held twice (a tied lm_head) is placed once
            moved[id(t)] = (t, _pinned_copy(t) if t is host_table else t.to(device))
        return moved[id(t)][1]

    _place_attributes(model, place)
    host_bytes = 0 if host_table is None else host_table.nbytes
    model.placed = Placed(sum(t.nbytes for t, _ in moved.values()) - host_bytes, host_bytes)
    return model


def device_weights(rad: RadFile, device: torch.device | str, dtype: torch.dtype | None = None,
                   read: Weights | None = None) -> Weights:
    """The getter of a `.rad`'s stored tensors (checksums verified) in the form `device`'s backend reads,
    still on the host (`load_model` places them after); `read` gets a stored tensor by name where that
    is not the whole of it, checked (a `--tp` card's part: model/sharded_loader.py):

    - a plain tensor cast to `dtype` if given (a view of the file without a cast);
    - on the CPU, a compact matrix as its bytes (a view of the file), which the host backend's block
      kernels read in place (kernels/cpu_blocks.py, the lm_head included);
    - off the CPU, a compact matrix as its bytes, which the Triton linear dequantizes in registers
      (kernels/linear.py, the lm_head's gemv included); and a compact embedding table dequantized once to
      the activations' dtype: the row gather (kernels/embedding.py, or F.embedding on the card)
      reads dense rows, and dequantizing rows in the step (`CompactWeight.rows`) takes torch launches
      a decode graph cannot capture. The receipt charges that dense table (sizing.ModelFacts.card_weights).
    """
    cpu = torch.device(device).type == "cpu"
    act = dtype or activation_dtype(rad)
    read = read or (lambda name: rad.tensor(name, verify=True))

    def weights(name: str) -> torch.Tensor | CompactWeight:
        t = read(name)
        if not isinstance(t, CompactWeight):
            return t.to(dtype or t.dtype)  # on the host: no copy without a cast
        return t.dequantize(act) if name == EMBEDDINGS and not cpu else t

    return weights


def dense_lm_head(model: CausalLM) -> None:
    """On the CPU, a compact lm_head in a format the block kernels do not read (`formats.CPU_BLOCKS`:
    fp8_b128) dequantized once to the activations' dtype: it is read whole every step, and dequantizing it
    per use would cost more than the matmul. A tied table keeps its compact bytes for the lookups."""
    head = model.lm_head.weight
    if isinstance(head, CompactWeight) and head.fmt not in CPU_BLOCKS:
        model.lm_head.weight = head.dequantize(model.norm.weight.dtype)


def refuse_unread_formats(rad: RadFile, device: torch.device | str) -> None:
    """RadError off the CPU for a model with tensors or expert extents in a compact format the Triton
    kernels do not read (`formats.COMPACT_TILES`: the K-quants of a Q4_K_M GGUF are read on the CPU
    only), naming the format and the two ways out. The embedding table is exempt: it is dequantized at
    load there (`device_weights`)."""
    if torch.device(device).type == "cpu":
        return
    unread = [(t.name, t.dtype) for t in rad.header.tensors
              if FORMATS[t.dtype].compact and t.dtype not in COMPACT_TILES and t.name != EMBEDDINGS]
    unread += [(f"the routed experts of layer {e.layer}", e.dtype) for e in rad.header.experts
               if any(FORMATS[f].compact and f not in COMPACT_TILES for f in expert_formats(e.dtype))]
    if unread:
        name, fmt = unread[0]
        formats = sorted({f for _, fmts in unread for f in fmts.split("+") if f not in COMPACT_TILES})
        raise RadError(f"{rad.path}: {name}: stored as {fmt} ({len(unread)} tensors or expert layers in "
                       f"{', '.join(formats)}), which the GPU kernels do not read (they read "
                       f"{', '.join(COMPACT_TILES)}). Requantize it, e.g. radiancectl convert SOURCE OUT.rad "
                       f"--quantize experts=int4,layers=int8,embeddings=int8 (int8: q8_0, int4: q4_0, fp8: "
                       f"fp8_b128), or serve it on the CPU (CUDA_VISIBLE_DEVICES=)")


def _place_attributes(obj: object, place) -> None:
    """Replace every tensor reachable from `obj`'s attributes (through lists, tuples, dicts and the
    model's own blocks) by `place(tensor)`, in place; what holds no tensor is left untouched (a
    container is rebuilt only when something in it was replaced)."""
    for name, value in list(vars(obj).items()):
        placed = _placed(value, place)
        if placed is not value:
            setattr(obj, name, placed)


def _placed(value, place):
    if isinstance(value, torch.Tensor):
        return place(value)
    if isinstance(value, CompactWeight):  # its bytes (a CPU packing is never made off the CPU)
        data = place(value.data)
        return value if data is value.data else CompactWeight(value.fmt, value.shape, data)
    if isinstance(value, RowStack):
        parts = _placed(value.parts, place)
        return value if parts is value.parts else RowStack(parts)
    if isinstance(value, dict):
        placed = {k: _placed(v, place) for k, v in value.items()}
        return value if all(placed[k] is v for k, v in value.items()) else placed
    if isinstance(value, (list, tuple)):
        items = [_placed(v, place) for v in value]
        return value if all(p is v for p, v in zip(items, value)) else type(value)(items)
    module = type(value).__module__
    if module.startswith("radianced.model.") and module not in _UNWALKED and hasattr(value, "__dict__"):
        _place_attributes(value, place)
    return value


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` copied into anonymous host memory of its own size and registered with CUDA: a
    kernel on the device reads its rows by address. The registration lasts as long as the copy.

    A copy, not the file's view: that mapping is read-only copy-on-write, and its pages are the page
    cache's to evict; pinning them would lock file pages for as long as the daemon runs."""
    memory = mmap.mmap(-1, t.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # page-aligned, whole pages
    table = torch.frombuffer(memory, dtype=t.dtype).view(t.shape)
    table.copy_(t)
    if torch.cuda.is_available():
        try:
            register_pinned(table, table, memory)
        except PinError as e:
            raise RadError(f"cannot pin the embedding table ({t.nbytes / (1 << 20):.1f} MiB) in host RAM: {e}; raise "
                           f"the locked-memory limit (LimitMEMLOCK=infinity, ulimit -l) or give "
                           f"--embedding-placement vram") from None
    return table
