"""The KV tensors: paged K/V of the full-attention layers, and the recurrent-state slots.

What a model forward reads and writes besides its weights (model/batch.py's
`ForwardBatch` says which tokens). The engine builds the K/V storage as a view
over the arena's pages (kv/blocks.py hands out its blocks); the recurrent
state (Gated DeltaNet conv window and recurrent matrix) has slots of its own
that kv/state.py allocates to sequences.
"""

from __future__ import annotations

import torch

from radianced.kernels.kv_formats import KV_FORMATS, KVFormat
from radianced.kernels.kv_quant import KVPlane
from radianced.model.config import ModelConfig


class KVCache:
    """Paged K/V of the full-attention layers, one paging group.

    With `--kv-cache-dtype auto` storage is [P, N, L, 2, S, Hkv, D] in the
    activations' dtype: P pages of N blocks; a block holds S tokens of K and V for
    all L attention layers, so a block is one contiguous piece of memory that can
    live in an arena page. `layer(i)` gives the [P, N, S, Hkv, D] views the
    attention op reads. A quantized format (kernels/kv_formats.py) keeps the same
    contiguity in bytes: storage is uint8 [P, N, block_bytes] and `layer(i)` gives
    its K and V as `KVPlane`s (codes and scales viewed inside each block).
    """

    def __init__(self, storage: torch.Tensor, layers: tuple[int, ...], states: RecurrentState | None = None,
                 fmt: KVFormat | None = None, geometry: tuple[int, int, int] | None = None):
        """storage: [P, N, L, 2, S, Hkv, D] (fmt None), or uint8 [P, N, fmt.block_bytes(L, S, Hkv, D)] with
        geometry (S, Hkv, D)."""
        self.storage, self.states, self.fmt = storage, states, fmt
        self.blocks_per_page = storage.shape[1]
        self._index = {layer: i for i, layer in enumerate(layers)}
        if fmt is None:
            self.block_size = storage.shape[4]
            self._planes = [(storage[:, :, i, 0], storage[:, :, i, 1]) for i in range(len(layers))]  # made once
        else:
            self.block_size = geometry[0]
            self._planes = _planes(storage, len(layers), fmt, *geometry)

    @classmethod
    def allocate(cls, cfg: ModelConfig, num_blocks: int, block_size: int, num_state_slots: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", kv_dtype: str = "auto") -> KVCache:
        """A standalone cache of num_blocks blocks (one block per page), its K/V in `kv_dtype` (a
        `--kv-cache-dtype`; auto: `dtype`) and, for hybrid models, num_state_slots recurrent-state
        slots (in `dtype` whatever `kv_dtype` is)."""
        layers = cfg.full_attention_layers
        fmt = kv_format(kv_dtype)
        geometry = (block_size, cfg.num_key_value_heads, cfg.head_dim)
        if fmt is None:
            storage = torch.zeros((num_blocks, 1, len(layers), 2, *geometry), dtype=dtype, device=device)
        else:
            storage = torch.zeros((num_blocks, 1, fmt.block_bytes(len(layers), *geometry)), dtype=torch.uint8,
                                  device=device)
        states = RecurrentState.allocate(cfg, num_state_slots, dtype, device) if cfg.linear_attention_layers else None
        return cls(storage, layers, states, fmt, geometry)

    @property
    def num_blocks(self) -> int:
        return self.storage.shape[0] * self.storage.shape[1]

    @property
    def dtype_name(self) -> str:
        """What the log and metrics call the cache's dtype: the format's name or the torch dtype's."""
        return self.fmt.name if self.fmt is not None else str(self.storage.dtype).removeprefix("torch.")

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | tuple[KVPlane, KVPlane]:
        return self._planes[self._index[layer]]


def kv_format(kv_dtype: str) -> KVFormat | None:
    """The format of a `--kv-cache-dtype` (None for auto); ValueError naming the choices otherwise."""
    if kv_dtype == "auto":
        return None
    if kv_dtype not in KV_FORMATS:
        raise ValueError(f"kv cache dtype {kv_dtype!r}: choose auto, {', '.join(KV_FORMATS)}")
    return KV_FORMATS[kv_dtype]


def _planes(storage: torch.Tensor, layers: int, fmt: KVFormat, s: int, hkv: int, d: int):
    """Each layer's (K, V) planes viewed inside uint8 storage [P, N, block_bytes]."""
    p, n = storage.shape[:2]
    per_layer = fmt.layer_bytes(s, hkv, d)
    (kc, kn), (vc, vn), (ks, ksn), (vs, vsn) = fmt.pieces(s, hkv, d)
    out = []
    for i in range(layers):
        base = i * per_layer

        def piece(at: int, nbytes: int) -> torch.Tensor:
            return storage[:, :, base + at: base + at + nbytes]

        k_codes = piece(kc, kn).view(p, n, s, hkv, fmt.k.code_bytes(d))
        v_codes = piece(vc, vn).view(p, n, s, hkv, fmt.v.code_bytes(d))
        k_scales = piece(ks, ksn).view(torch.float16).view(p, n, *fmt.k.scale_shape(s, hkv, d))
        v_scales = piece(vs, vsn).view(torch.float16).view(p, n, *fmt.v.scale_shape(s, hkv, d))
        out.append((KVPlane(fmt.k, k_codes, k_scales, d), KVPlane(fmt.v, v_codes, v_scales, d)))
    return out


class RecurrentState:
    """Per-sequence state slots of the linear-attention (Gated DeltaNet) layers.

    conv: [L, slots, C, K-1] (the last K-1 conv inputs, model dtype) and
    recurrent: [L, slots, Hv, Dk, Dv] (fp32) for the L linear-attention layers.
    A sequence owns one slot index across all of them; `reset` zeroes it.

    With speculative decoding (`drafts_per_seq` N > 0) the first `num_seqs` slots are the
    sequences' and N more per sequence follow them (`draft_slot`): a verify step leaves the state
    after its j-th position there, and the state after the position its drafts were accepted to
    becomes the sequence's (`copy_slot`). N+1 copies per sequence: what the budget charges.
    """

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor, layers: tuple[int, ...], drafts_per_seq: int = 0):
        self.conv, self.recurrent = conv, recurrent
        self.drafts_per_seq = drafts_per_seq
        self.num_seqs = conv.shape[1] // (1 + drafts_per_seq)
        self._index = {layer: i for i, layer in enumerate(layers)}

    @classmethod
    def allocate(cls, cfg: ModelConfig, slots: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 drafts_per_seq: int = 0):
        """`slots` sequences' slots, and `drafts_per_seq` draft slots for each of them."""
        layers = cfg.linear_attention_layers
        slots *= 1 + drafts_per_seq
        channels = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
        conv = torch.zeros((len(layers), slots, channels, cfg.linear_conv_kernel_dim - 1), dtype=dtype, device=device)
        recurrent = torch.zeros((len(layers), slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                 cfg.linear_value_head_dim), dtype=torch.float32, device=device)
        return cls(conv, recurrent, layers, drafts_per_seq)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self._index[layer]
        return self.conv[i], self.recurrent[i]

    def draft_slot(self, slot: int, position: int) -> int:
        """Where a verify step of sequence slot `slot` leaves the state after its `position`-th token
        (0: the sequence's last token, j: its j-th draft)."""
        if not 0 <= position < self.drafts_per_seq or not 0 <= slot < self.num_seqs:
            raise IndexError(f"no draft slot {position} of state slot {slot} ({self.num_seqs} sequences x "
                             f"{self.drafts_per_seq} drafts)")
        return self.num_seqs + slot * self.drafts_per_seq + position

    def copy_slot(self, slot: int, dst: RecurrentState, dst_slot: int) -> None:
        """Copy this pool's `slot` into `dst`'s `dst_slot` (same model, e.g. state slot <-> checkpoint)."""
        dst.conv[:, dst_slot].copy_(self.conv[:, slot])
        dst.recurrent[:, dst_slot].copy_(self.recurrent[:, slot])

    def reset(self, slot: int) -> None:
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()
