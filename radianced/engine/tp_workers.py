"""The ranks of `--tp N` beyond the first: each holds its card's share of the model, its own paged
KV cache for its KV heads and its own recurrent-state slots for its DeltaNet heads, and runs every
step rank 0's engine plans.

Rank 0 runs the engine (scheduler, sampler, the HTTP side): its runner hands each step to
`StepBroadcast.send` before its own forward, and every rank then runs the same forward on its
shard (the collectives inside meet in the same order). What goes over is the step's layout (the
host lists `ForwardBatch.build` takes, one pickled object) and then its input ids as a tensor
(the ids a pipelined step reads from the previous step's samples are only on rank 0's device).
The block tables are rank 0's: every rank's cache has the same blocks, each holding that rank's
KV heads, so one allocator's decisions serve all. Sampling is rank 0's alone: the logits are
gathered there.

Not mirrored yet, refused where `--tp` is set up: CUDA decode graphs (the replay would skip the
send), speculative decoding (the kept draft state depends on rank 0's samples) and the MTP head.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from radianced.config import Config
from radianced.engine.runner import copy_states
from radianced.engine.tp_memory import rank_memory
from radianced.kv.cache import KVCache, RecurrentState
from radianced.kv.state import StateCopy
from radianced.model.batch import ForwardBatch
from radianced.model.layers import CausalLM
from radianced.model.parallel import ProcessGroup
from radianced.model.rad import RadFile
from radianced.model.sharded_loader import load_shard


@dataclass(frozen=True)
class WorkerStep:
    """One step as a rank beyond the first runs it.

    before: the plan's state copies to apply before the forward (hybrid models).
    layout: `ForwardBatch.build`'s arguments but `device` (token ids, context lengths, block tables,
        block size, logits rows, state slots, drafts); the ids are then overwritten by the
        broadcast tensor.
    after: the plan's state copies to apply after the forward.
    """

    before: tuple[StateCopy, ...]
    layout: dict
    after: tuple[StateCopy, ...]


class StepBroadcast:
    """Rank 0's side: each step to every other rank (`send`), then `close` to end their loops.

    seconds: the time spent in `send` so far, steps: how many (the transport's per-step cost).
    """

    def __init__(self) -> None:
        self.seconds, self.steps = 0.0, 0

    def send(self, before: tuple[StateCopy, ...], layout: dict, after: tuple[StateCopy, ...],
             input_ids: torch.Tensor) -> None:
        start = time.perf_counter()
        dist.broadcast_object_list([WorkerStep(before, layout, after)], src=0)
        dist.broadcast(input_ids, src=0)
        self.seconds += time.perf_counter() - start
        self.steps += 1

    def close(self) -> None:
        """Tell every other rank that no step follows (their `serve_steps` returns)."""
        dist.broadcast_object_list([None], src=0)


@dataclass
class WorkerShard:
    """A rank's share of the engine's device state: its model, KV cache and state checkpoints."""

    model: CausalLM
    cache: KVCache
    checkpoints: RecurrentState | None

    @classmethod
    def build(cls, rad: RadFile, cfg: Config, group: ProcessGroup, num_blocks: int, block_size: int,
              device: torch.device | str = "cpu") -> WorkerShard:
        """As `Engine.assemble` builds rank 0's (the same state slots and checkpoints), over a cache of
        `num_blocks` blocks of `block_size` tokens (rank 0's count) for this rank's KV heads."""
        model = load_shard(rad, group, device)
        m = model.cfg
        storage = torch.zeros((num_blocks, 1, len(m.full_attention_layers), 2, block_size, m.num_key_value_heads,
                               m.head_dim), dtype=model.norm.weight.dtype, device=device)
        return cls._over(model, cfg, storage, device)

    @classmethod
    def for_card(cls, rad: RadFile, cfg: Config, group: ProcessGroup,
                 device: torch.device | str = "cpu") -> WorkerShard:
        """As `Engine.build` builds rank 0's: this card's receipt, arena, KV view and pinned experts."""
        memory = rank_memory(rad, cfg, group, device)
        return cls._over(load_shard(rad, group, device, experts=memory.experts), cfg, memory.kv_storage, device)

    @classmethod
    def _over(cls, model: CausalLM, cfg: Config, storage: torch.Tensor, device: torch.device | str) -> WorkerShard:
        m, dtype = model.cfg, model.norm.weight.dtype
        hybrid = bool(m.linear_attention_layers)
        states = RecurrentState.allocate(m, cfg.max_num_seqs, dtype, device) if hybrid else None
        cache = KVCache(storage, m.full_attention_layers, states, None, (storage.shape[-3], *storage.shape[-2:]))
        checkpoints = RecurrentState.allocate(m, 2 * cfg.max_num_seqs, dtype, device) if hybrid else None
        return cls(model, cache, checkpoints)

    def serve_steps(self) -> int:
        """Run the steps rank 0 broadcasts until it stops; returns how many ran."""
        device, steps = self.cache.storage.device, 0
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0)
            step: WorkerStep | None = message[0]
            if step is None:
                return steps
            copy_states(step.before, self.cache.states, self.checkpoints)
            batch = ForwardBatch.build(**step.layout, device=device)
            dist.broadcast(batch.input_ids, src=0)
            with torch.inference_mode():
                self.model.forward(batch, self.cache)
            copy_states(step.after, self.cache.states, self.checkpoints)
            steps += 1
