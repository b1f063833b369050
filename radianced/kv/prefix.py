"""Prefix cache: full KV blocks keyed by the hash chain of their tokens.

Block i of a token stream is keyed by hash(key of block i-1, tokens of block i),
so a key names the whole prefix up to the end of its block. Only blocks whose
every token has been computed are inserted, and a cached block is never written
again (a sequence always computes from the end of its matched prefix into fresh
blocks), so sequences share cached blocks read-only.

The cache is a holder of each block it keeps (see `blocks.py`). A block only the
cache holds is *idle*: reusable by `match`, and evictable, least recently
released first (a table releases its tail first, so chains shrink from the end).
The allocator evicts through this object (`evictable()` / `evict(n)`) when it
runs short, and when the arena in lending mode takes KV pages back for expert
slots (`BlockAllocator.surrender_pages`, called by the engine's KV reclaimer).

Hybrid models (Qwen3-Next) cannot resume from KV alone: the DeltaNet layers need
their recurrent state at the point where computation resumes. Such a model keeps
*checkpoints* (recurrent-state copies, `state.CheckpointSlots`) attached to the
block that ends the prefix they belong to, evicted together with that block; a
hybrid match ends at the deepest block with a checkpoint.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from radianced.kv.blocks import BlockAllocator, BlockTable, KVBlock
from radianced.kv.state import CheckpointSlots


def hash_block(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The key of a block: 128-bit BLAKE2b of the parent key and the block's token ids
    (a cryptographic hash: a crafted collision would hand one user another's KV)."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def extend_block_hashes(hashes: list[bytes], tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Append to `hashes` the keys of the full blocks of `tokens` it lacks; returns `hashes`."""
    for i in range(len(hashes), len(tokens) // block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * block_size:(i + 1) * block_size]))
    return hashes


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """What a request can skip: `blocks` hold its first `num_tokens` tokens.

    checkpoint: on a hybrid model, the checkpoint slot holding the recurrent state
    after `num_tokens` tokens (None when nothing matched).
    num_evictable: how many of `blocks` only the cache holds (they stop being
    evictable once acquired, so `can_allocate` must not count them).
    """

    blocks: tuple[KVBlock, ...] = ()
    num_tokens: int = 0
    checkpoint: int | None = None
    num_evictable: int = 0


class _Entry:
    __slots__ = ("block", "checkpoint")

    def __init__(self, block: KVBlock):
        self.block = block
        self.checkpoint: int | None = None


class PrefixCache:
    """Hash-keyed cached blocks over a `BlockAllocator`; registers itself as its reclaimer."""

    def __init__(self, allocator: BlockAllocator, hybrid: bool = False, checkpoints: CheckpointSlots | None = None):
        if hybrid and checkpoints is None:
            raise ValueError("a hybrid model's prefix cache needs checkpoint slots")
        self._alloc = allocator
        self.block_size = allocator.block_size
        self.hybrid = hybrid
        self.checkpoints = checkpoints if hybrid else None
        self._entries: dict[bytes, _Entry] = {}
        self._key_of: dict[KVBlock, bytes] = {}
        self._idle: OrderedDict[bytes, None] = OrderedDict()  # first = least recently released
        allocator.reclaimer = self

    @property
    def num_cached(self) -> int:
        return len(self._entries)

    @property
    def num_checkpoints(self) -> int:
        return sum(e.checkpoint is not None for e in self._entries.values())

    def cached_blocks(self) -> list[tuple[KVBlock, int | None]]:
        """Every cached block with its checkpoint slot (or None), in insertion order."""
        return [(e.block, e.checkpoint) for e in self._entries.values()]

    # -- lookups --------------------------------------------------------------

    def match(self, tokens: Sequence[int], hashes: list[bytes] | None = None) -> PrefixMatch:
        """The longest cached prefix of `tokens` a request can start from. Whole blocks,
        and never all of `tokens`: the last token is always computed (its logits are
        sampled). Hybrid: only up to the deepest block with a checkpoint. Takes no holds.

        `hashes`: the caller's list of block keys of `tokens`, extended in place.
        """
        usable = (len(tokens) - 1) // self.block_size if tokens else 0
        hashes = extend_block_hashes([] if hashes is None else hashes, tokens[:usable * self.block_size],
                                     self.block_size)
        blocks: list[KVBlock] = []
        best, checkpoint = 0, None
        for key in hashes[:usable]:
            entry = self._entries.get(key)
            if entry is None:
                break
            blocks.append(entry.block)
            if not self.hybrid:
                best = len(blocks)
            elif entry.checkpoint is not None:
                best, checkpoint = len(blocks), entry.checkpoint
        blocks = blocks[:best]
        idle = sum(self._key_of[b] in self._idle for b in blocks)
        return PrefixMatch(tuple(blocks), best * self.block_size, checkpoint, idle)

    def acquire(self, match: PrefixMatch, table: BlockTable) -> None:
        """Append the matched blocks to the (empty) `table`, which becomes a holder.
        Call right after `match`, with no eviction in between."""
        if len(table):
            raise ValueError("a prefix goes at the start of an empty table")
        for b in match.blocks:
            if b not in self._key_of:
                raise ValueError(f"block {b} left the cache between match and acquire")
        self._alloc.share(table, match.blocks)
        for b in match.blocks:
            self._idle.pop(self._key_of[b], None)

    # -- filling --------------------------------------------------------------

    def insert(self, table: BlockTable, hashes: Sequence[bytes], start: int, stop: int) -> None:
        """Cache blocks start..stop-1 of `table`, whose keys are hashes[start:stop]; every
        token in them must be computed. A key already cached keeps its block (the
        table's twin stays private and is freed with the table)."""
        for i in range(start, stop):
            key, block = hashes[i], table[i]
            if key in self._entries or block in self._key_of:
                continue
            self._entries[key] = _Entry(block)
            self._key_of[block] = key
            self._alloc.hold([block])

    def take_checkpoint(self) -> int | None:
        """A free checkpoint slot, detaching the least recently released idle block's
        checkpoint if none is free; None when every checkpoint is in use."""
        assert self.checkpoints is not None
        if not self.checkpoints.num_free:
            for key in self._idle:
                entry = self._entries[key]
                if entry.checkpoint is not None:
                    self.checkpoints.free(entry.checkpoint)
                    entry.checkpoint = None
                    break
            else:
                return None
        return self.checkpoints.allocate()

    def attach_checkpoint(self, key: bytes, slot: int) -> bool:
        """Keep checkpoint `slot` (the state after the block keyed `key`) with that block.
        False (the caller keeps the slot) if the block is not cached or has one already."""
        entry = self._entries.get(key)
        if entry is None or entry.checkpoint is not None:
            return False
        entry.checkpoint = slot
        return True

    # -- the reclaimer side (allocator, arena) ----------------------------------

    def evictable(self) -> int:
        return len(self._idle)

    def evict(self, n: int) -> int:
        """Evict up to n idle blocks, least recently released first, with their checkpoints."""
        done = 0
        while done < n and self._idle:
            key, _ = self._idle.popitem(last=False)
            entry = self._entries.pop(key)
            del self._key_of[entry.block]
            if entry.checkpoint is not None:
                self.checkpoints.free(entry.checkpoint)
            self._alloc.drop([entry.block])
            done += 1
        return done

    def released(self, blocks: Sequence[KVBlock]) -> None:
        for b in blocks:
            key = self._key_of.get(b)
            if key is not None and self._alloc.ref_count(b) == 1:
                self._idle[key] = None
