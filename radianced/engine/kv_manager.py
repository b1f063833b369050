"""A sequence's KV and recurrent state as the scheduler takes and gives them back.

`KVManager` holds, for each running sequence, what it holds beyond its tokens:
its block table (a prefix hit first, then fresh blocks), on hybrid models its
recurrent-state slot, and with a prefix cache its full blocks and its
checkpoint. The scheduler decides who runs; this decides nothing, it keeps the
books: where a sequence starts (`match`), what starting it takes (`can_start`,
`start`), which checkpoint saves a chunk carries (`checkpoint_saves`), what the
prefix cache is offered (`cache_blocks`, `hand_over_checkpoint`) and what a
sequence gives back when it stops (`release`).

Hybrid models with a prefix cache take a checkpoint at the prompt's last block
boundary (`checkpoint_at`: a later request with the same prompt must compute at
least one token) and where a chunk samples at a block boundary; the sequence
owns it until it hands it to the prefix cache. No torch, no CUDA.
"""

from __future__ import annotations

from collections.abc import Iterable

from radianced.engine.plan import StepPlan
from radianced.engine.request import Sequence
from radianced.kv.blocks import BlockAllocator
from radianced.kv.prefix import PrefixCache, PrefixMatch, extend_block_hashes
from radianced.kv.state import StateCopy, StateSlots


class KVManager:
    """Blocks, prefix hits, state slots and checkpoints of the scheduler's sequences."""

    def __init__(self, allocator: BlockAllocator, prefix: PrefixCache | None, state_slots: StateSlots | None):
        """state_slots: one recurrent-state slot per running sequence (hybrid models), else None."""
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.prefix = prefix
        self.state_slots = state_slots
        self._checkpoints = state_slots is not None and prefix is not None

    def match(self, seq: Sequence) -> PrefixMatch:
        """The longest cached prefix the waiting `seq` can start after (nothing without a cache)."""
        return self.prefix.match(seq.token_ids, seq.block_hashes) if self.prefix else PrefixMatch()

    def checkpoint_at(self, seq: Sequence, start: int) -> int:
        """The last block boundary a later request could resume from (it must compute
        at least one token), if a checkpoint there is worth taking; else 0."""
        if not self._checkpoints:
            return 0
        at = (seq.num_tokens - 1) // self.block_size * self.block_size
        return at if at > start else 0

    def can_start(self, match: PrefixMatch, tokens: int) -> bool:
        """Could `start` give a sequence starting after `match` blocks for its first `tokens` tokens?"""
        need = self.allocator.blocks_for(tokens) - len(match.blocks)
        return self.allocator.can_allocate(need, exclude=match.num_evictable)

    def start(self, seq: Sequence, match: PrefixMatch, tokens: int) -> list[StateCopy]:
        """Give `seq` the matched blocks, fresh blocks up to `tokens` tokens and (hybrid) a state
        slot; returns the copies that set that slot up before its first chunk (a reset, or the
        match's checkpoint restored). Call right after `match` and a True `can_start`."""
        if self.prefix is not None:
            self.prefix.acquire(match, seq.block_table)
        self.allocator.append(seq.block_table, tokens)
        seq.num_cached_blocks = len(match.blocks)
        if self.state_slots is None:
            return []
        seq.state_slot = self.state_slots.allocate()
        return [StateCopy.reset(seq.state_slot) if match.checkpoint is None
                else StateCopy.restore(match.checkpoint, seq.state_slot)]

    def checkpoint_saves(self, seq: Sequence, end: int, sample: bool) -> list[StateCopy]:
        """The save a chunk of `seq` ending at token `end` carries: at a block boundary that is
        the prompt's checkpoint or where it samples, into the sequence's checkpoint slot (taken
        now if it has none). [] elsewhere, or when every checkpoint slot is in use."""
        if not self._checkpoints or end % self.block_size or not (end == seq.checkpoint_at or sample):
            return []
        if seq.checkpoint is None:
            seq.checkpoint = self.prefix.take_checkpoint()
        return [] if seq.checkpoint is None else [StateCopy.save(seq.state_slot, seq.checkpoint)]

    def cache_blocks(self, seq: Sequence, computed: int) -> None:
        """Offer the prefix cache the full blocks of the first `computed` tokens (all confirmed:
        a plan ahead's PENDING token and the KV after it are never in them)."""
        if self.prefix is None:
            return
        full = computed // self.block_size
        if full > seq.num_cached_blocks:
            extend_block_hashes(seq.block_hashes, seq.token_ids[:full * self.block_size], self.block_size)
            self.prefix.insert(seq.block_table, seq.block_hashes, seq.num_cached_blocks, full)
            seq.num_cached_blocks = full

    def hand_over_checkpoint(self, seq: Sequence, in_flight: Iterable[StepPlan]) -> None:
        """Give the sequence's checkpoint to the prefix cache if it holds a state the
        sequence has reached (and no save into it is in flight); else free it."""
        slot, tokens = seq.checkpoint, seq.checkpoint_tokens
        seq.checkpoint, seq.checkpoint_tokens = None, 0
        if slot is None:
            return
        saving = any(c.checkpoint == slot for plan in in_flight for c in plan.after)
        if tokens and not saving and tokens <= seq.num_computed_tokens \
                and self.prefix.attach_checkpoint(seq.block_hashes[tokens // self.block_size - 1], slot):
            return
        self.prefix.checkpoints.free(slot)

    def release(self, seq: Sequence, in_flight: Iterable[StepPlan]) -> None:
        """Everything `seq` holds goes back: its checkpoint (see `hand_over_checkpoint`), its
        blocks (the prefix cache keeps those it cached) and its state slot."""
        self.hand_over_checkpoint(seq, in_flight)
        self.allocator.free(seq.block_table)
        if seq.state_slot is not None:
            self.state_slots.free(seq.state_slot)
            seq.state_slot = None
