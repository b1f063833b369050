"""The KV tensors: paged K/V of the full-attention layers, and the recurrent-state slots.

What a model forward reads and writes besides its weights (model/batch.py's
`ForwardBatch` says which tokens). The engine builds the K/V storage as a view
over the arena's pages (kv/blocks.py hands out its blocks); the recurrent
state (Gated DeltaNet conv window and recurrent matrix) has slots of its own
that kv/state.py allocates to sequences.
"""

from __future__ import annotations

import torch

from radianced.model.config import ModelConfig


class KVCache:
    """Paged K/V of the full-attention layers, one paging group.

    Storage is [P, N, L, 2, S, Hkv, D]: P pages of N blocks; a block holds S
    tokens of K and V for all L attention layers, so a block is one contiguous
    piece of memory that can live in an arena page. `layer(i)` gives the
    [P, N, S, Hkv, D] views the attention op reads.
    """

    def __init__(self, storage: torch.Tensor, layers: tuple[int, ...], states: RecurrentState | None = None):
        # storage: [P, N, L, 2, S, Hkv, D]
        self.storage = storage
        self.states = states
        self.block_size = storage.shape[4]
        self.blocks_per_page = storage.shape[1]
        self._index = {layer: i for i, layer in enumerate(layers)}

    @classmethod
    def allocate(cls, cfg: ModelConfig, num_blocks: int, block_size: int, num_state_slots: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> KVCache:
        """A standalone cache of num_blocks blocks (one block per page) and, for hybrid
        models, num_state_slots recurrent-state slots."""
        layers = cfg.full_attention_layers
        storage = torch.zeros((num_blocks, 1, len(layers), 2, block_size, cfg.num_key_value_heads, cfg.head_dim),
                              dtype=dtype, device=device)
        states = RecurrentState.allocate(cfg, num_state_slots, dtype, device) if cfg.linear_attention_layers else None
        return cls(storage, layers, states)

    @property
    def num_blocks(self) -> int:
        return self.storage.shape[0] * self.storage.shape[1]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self._index[layer]
        return self.storage[:, :, i, 0], self.storage[:, :, i, 1]


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
