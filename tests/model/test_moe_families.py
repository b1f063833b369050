"""The MoE families' own contracts (issue 3), beyond agreeing with transformers.

Models are built from transformers' in-memory state dict of a tiny random
checkpoint (fp32), with routed experts served by `ResidentExperts.from_weights`;
the `.rad` converter path is covered by `test_families_oracle.py`. Nothing here
runs a transformers forward, so the module stays fast.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM

from radianced.kernels import ops
from radianced.kv.cache import KVCache
from radianced.model.batch import ForwardBatch
from radianced.model.config import ModelConfig
from radianced.model.experts import ResidentExperts
from radianced.model.layers import CausalLM
from radianced.model.loader import build_model
from radianced.model.tiny import make_tiny

BLOCK_SIZE = 16
PROMPT_LEN = 80  # > 64, the DeltaNet chunk, so a split can land on either side of a chunk edge
SPLITS = (1, 15, 16, 17, 63, 64, 79)
BLOCK_TABLE = [7, 2, 9, 0, 4]  # non-contiguous and out of order: the layout comes only from the table
STATE_SLOT = 2  # not slot 0: the slot index is honoured


@dataclass
class Tiny:
    cfg: ModelConfig
    state: dict[str, torch.Tensor]  # transformers' state dict
    experts: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # layer -> gate, up, down [E, ...]

    def resident(self) -> ResidentExperts:
        return ResidentExperts.from_weights(self.experts)

    def model(self, experts) -> CausalLM:
        asked: list[str] = []

        def weights(name: str) -> torch.Tensor:
            asked.append(name)
            return self.state[name]

        model = build_model(self.cfg, weights, experts)
        # The model never asks the weights getter for routed experts: they come only through `experts`.
        assert not [n for n in asked if ".mlp.experts." in n]
        return model

    def cache(self, slots: int = 3) -> KVCache:
        return KVCache.allocate(self.cfg, num_blocks=16, block_size=BLOCK_SIZE, num_state_slots=slots,
                                dtype=torch.float32)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next"])
def tiny(request, tmp_path_factory) -> Tiny:
    src = make_tiny(request.param, tmp_path_factory.mktemp(request.param))
    cfg = ModelConfig.from_hf(json.loads((src / "config.json").read_text()))
    if cfg.family == "qwen3_next":
        assert set(cfg.layer_types) == {"linear_attention", "full_attention"}
    state = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).state_dict()
    inter = cfg.moe_intermediate_size
    experts = {}
    for layer in cfg.moe_layers:
        # transformers holds a layer's experts fused: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]
        gate_up = state[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        experts[layer] = (gate_up[:, :inter], gate_up[:, inter:], state[f"model.layers.{layer}.mlp.experts.down_proj"])
    return Tiny(cfg, state, experts)


def _prompt(cfg: ModelConfig, n: int, seed: int = 3) -> list[int]:
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill(model: CausalLM, cache: KVCache, chunks: list[list[int]]) -> torch.Tensor:
    """Prefill one sequence chunk by chunk (same block table, same state slot); the last chunk's last-row logits."""
    before = 0
    for chunk in chunks:
        batch = ForwardBatch.build([chunk], [before], [BLOCK_TABLE], BLOCK_SIZE, state_slots=[STATE_SLOT])
        with torch.inference_mode():
            logits = model.forward(batch, cache)  # [1, V]
        before += len(chunk)
    return logits[0]


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def _written_kv(cache: KVCache, layer: int, tokens: int) -> torch.Tensor:
    """[2, tokens, Hkv, D]: K and V of the sequence's first `tokens` positions, gathered through BLOCK_TABLE."""
    rows = []
    for kv in cache.layer(layer):  # [P, N, S, Hkv, D], one block per page
        blocks = kv[:, 0][torch.tensor(BLOCK_TABLE)]  # [blocks, S, Hkv, D]
        rows.append(blocks.flatten(0, 1)[:tokens])
    return torch.stack(rows)


@pytest.fixture(scope="module")
def one_chunk(tiny) -> tuple[CausalLM, KVCache, torch.Tensor]:
    """The resident model, and its cache and last-row logits after prefilling the prompt in one chunk."""
    model = tiny.model(tiny.resident())
    cache = tiny.cache()
    return model, cache, _prefill(model, cache, [_prompt(tiny.cfg, PROMPT_LEN)])


@pytest.mark.parametrize("split", SPLITS)
def test_prefill_in_two_chunks_equals_one_chunk(tiny, one_chunk, split):
    """Chunk 2 starts from chunk 1's KV blocks and state slot; state, KV and logits equal a one-chunk prefill.

    Both chunkings compute the same math in a different order (DeltaNet's chunk
    edges move, attention's key set is split), so they agree to fp32 rounding.
    """
    model, whole, ref = one_chunk
    prompt = _prompt(tiny.cfg, PROMPT_LEN)
    halves = tiny.cache()
    ours = _prefill(model, halves, [prompt[:split], prompt[split:]])

    assert _rel(ours, ref) < 1e-5
    for layer in tiny.cfg.full_attention_layers:
        assert _rel(_written_kv(halves, layer, PROMPT_LEN), _written_kv(whole, layer, PROMPT_LEN)) < 1e-5, layer
    others = [b for b in range(halves.num_blocks) if b not in BLOCK_TABLE]
    assert not halves.storage[others].any(), "KV written outside the sequence's blocks"
    for layer in tiny.cfg.linear_attention_layers:
        (conv, rec), (conv_ref, rec_ref) = halves.states.layer(layer), whole.states.layer(layer)
        assert _rel(conv[STATE_SLOT], conv_ref[STATE_SLOT]) < 1e-5, layer
        assert _rel(rec[STATE_SLOT], rec_ref[STATE_SLOT]) < 1e-5, layer
        for other in {0, 1} - {STATE_SLOT}:  # other sequences' slots untouched
            assert not conv[other].any() and not rec[other].any()


class _RoutingLog:
    """An ExpertSource wrapper that records the expert ids each MoE layer asks for (its `prepare` calls)."""

    def __init__(self, inner: ResidentExperts):
        self.inner = inner
        self.routed: dict[int, list[torch.Tensor]] = {}

    @property
    def slab(self) -> torch.Tensor:
        return self.inner.slab

    @property
    def host(self) -> torch.Tensor | None:
        return self.inner.host

    @property
    def stages_experts(self) -> bool:
        return self.inner.stages_experts

    @property
    def staging(self) -> torch.Tensor | None:
        return self.inner.staging

    def table(self, layer: int) -> torch.Tensor:
        return self.inner.table(layer)

    def weight_format(self, layer: int) -> str | None:
        return self.inner.weight_format(layer)

    def prepare(self, layer: int, expert_ids: torch.Tensor) -> None:
        self.routed.setdefault(layer, []).append(expert_ids.clone())
        self.inner.prepare(layer, expert_ids)


def _swap_rows(t: torch.Tensor, a: int, b: int) -> None:
    t[[a, b]] = t[[b, a]]  # the right side is a copy, so this is a true in-place swap


def test_the_expert_table_is_the_only_way_to_expert_weights(tiny):
    """Swapping two experts' slab rows and their two table entries changes nothing (bit for bit);
    swapping only the slab rows changes the logits.

    The table and slab are mutated in place after the model is built, so this also
    proves the model reads the table at every step (the slab manager will patch it
    between steps) rather than a copy taken at build time.
    """
    source = _RoutingLog(tiny.resident())
    model = tiny.model(source)
    prompts = [_prompt(tiny.cfg, n, seed=n) for n in (17, 64)]
    tables = [list(range(b * 5, b * 5 + 5)) for b in range(2)]  # 5 blocks each, 16 blocks in the cache

    def run() -> torch.Tensor:
        batch = ForwardBatch.build(prompts, [0, 0], tables, BLOCK_SIZE, logits="all", state_slots=[0, 1])
        with torch.inference_mode():
            return model.forward(batch, tiny.cache())

    before = run()
    swaps = {}
    for layer in tiny.cfg.moe_layers:
        # the two experts this layer routes most tokens to, so the swap is certain to matter
        (a, _), (b, _) = Counter(source.routed[layer][0].flatten().tolist()).most_common(2)
        table = source.table(layer)
        swaps[layer] = a, b, int(table[a]), int(table[b])
        _swap_rows(source.slab, int(table[a]), int(table[b]))
        _swap_rows(table, a, b)
    assert torch.equal(run(), before), "table entries and slab rows swapped together changed the output"

    for layer, (a, b, row_a, row_b) in swaps.items():
        _swap_rows(source.table(layer), a, b)  # this layer's table back; its slab rows stay swapped
        assert (run() - before).abs().max() > 1e-3, f"layer {layer}: expert weights were not read through the table"
        _swap_rows(source.slab, row_a, row_b)  # this layer fully restored before the next is checked


class _StagedExperts:
    """A source that stages experts, as the disk tier does: every table entry points at a zeroed
    slab row until `prepare` points the routed experts of that call at their weights."""

    stages_experts = True
    host = staging = None

    def __init__(self, resident: ResidentExperts, layers: list[int]):
        self.slab = torch.cat([resident.slab, resident.slab.new_zeros(1, resident.slab.shape[1])])
        self._rows = {layer: resident.table(layer) for layer in layers}
        self._tables = {layer: torch.full_like(self._rows[layer], len(resident.slab)) for layer in layers}

    def table(self, layer: int) -> torch.Tensor:
        return self._tables[layer]

    def weight_format(self, layer: int) -> None:
        return None

    def prepare(self, layer: int, expert_ids: torch.Tensor) -> None:
        routed = expert_ids.unique()
        self._tables[layer][routed] = self._rows[layer][routed]


@pytest.mark.parametrize("tokens", [1, 17])
def test_a_source_that_stages_experts_is_prepared_before_they_are_read(tiny, tokens):
    """With `stages_experts` the layer routes in a launch of its own and calls `prepare` before its
    experts are read (kernels/moe.py's `route_moe` would read them first): a source whose experts
    are readable only once prepared gives the resident model's logits, bit for bit."""
    prompt = _prompt(tiny.cfg, tokens, seed=tokens)
    want = _prefill(tiny.model(tiny.resident()), tiny.cache(), [prompt])
    staged = _StagedExperts(tiny.resident(), tiny.cfg.moe_layers)
    assert torch.equal(_prefill(tiny.model(staged), tiny.cache(), [prompt]), want)


class _SlabProbe(torch.Tensor):
    """The slab, counting which rows are read.

    Every torch operation on the slab passes through `__torch_function__`. Row
    gathers (`index_select` on dim 0, integer / index-tensor `__getitem__`)
    record the rows they return; metadata queries pass; any other operation
    fails the test with its name, so no read can slip past the count.
    """

    _METADATA = {"shape", "dtype", "device", "ndim", "layout", "is_cuda", "size", "dim", "numel", "stride",
                 "element_size", "is_contiguous", "requires_grad"}
    reads: list[int]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(getattr(func, "__self__", None), "__name__", None) if func.__name__ == "__get__" \
            else func.__name__
        slab = args[0]
        if name in ("index_select",):
            dim, index = (args[1:] + (kwargs.get("dim"), kwargs.get("index")))[:2]
            assert dim == 0, "slab gathers are along the row axis"
            slab.reads.extend(index.tolist())
        elif name == "__getitem__":
            index = args[1]
            assert isinstance(index, (int, torch.Tensor)), f"slab indexed by {index!r}: extend the probe"
            slab.reads.extend(torch.as_tensor(index).flatten().tolist())
        elif name not in cls._METADATA:
            raise AssertionError(f"the MoE read the slab through {name}; the probe counts only row gathers")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)  # a plain tensor: reads of the result are not slab reads


def test_routed_tokens_are_grouped_so_each_expert_row_is_read_once_per_step(tiny):
    """One step (a batch of three sequences, 1 + 17 + 64 tokens) reads each routed expert's
    slab row exactly once per layer, for all of that expert's tokens together.

    The rows read are counted at the slab itself (see `_SlabProbe`), not by
    watching a particular helper of the MoE op, so the test holds for any
    torch implementation that groups tokens by expert and fails for one that
    gathers weights per token or per (token, k) assignment. The expected rows
    come from the router's choices (the source's `prepare` calls) through the
    tables. The step has several times more assignments than distinct experts,
    so per-token reads could not pass by accident.
    """
    resident = tiny.resident()
    probe = torch.Tensor._make_subclass(_SlabProbe, resident.slab)
    probe.reads = []
    source = _RoutingLog(ResidentExperts(probe, {layer: resident.table(layer) for layer in tiny.cfg.moe_layers}))
    model = tiny.model(source)
    prompts = [_prompt(tiny.cfg, n, seed=n) for n in (1, 17, 64)]
    tables = [[0], [1, 2], [3, 4, 5, 6]]
    batch = ForwardBatch.build(prompts, [0, 0, 0], tables, BLOCK_SIZE, state_slots=[0, 1, 2])
    with torch.inference_mode():
        logits = model.forward(batch, tiny.cache())
    assert torch.isfinite(logits).all()

    expected, assignments = [], 0
    for layer in tiny.cfg.moe_layers:
        (ids,) = source.routed[layer]  # one router call per layer per step: ids [T, k]
        assert ids.shape == (82, tiny.cfg.num_experts_per_tok)
        expected += source.table(layer)[ids.unique()].tolist()
        assignments += ids.numel()
    assert Counter(probe.reads) == Counter(expected)  # every routed expert's row, each exactly once
    assert len(set(expected)) == len(expected)
    assert assignments >= 4 * len(expected)


def test_a_hybrid_step_without_its_host_state_slots_is_refused(tiny):
    """A prefill or verify step walks its sequences by the host's copy of their state slots (reading the device's
    would sync the host in every linear-attention layer): a batch that lacks it is refused, not run empty."""
    if not tiny.cfg.linear_attention_layers:
        pytest.skip("no recurrent layers")
    model = tiny.model(tiny.resident())
    batch = ForwardBatch.build([_prompt(tiny.cfg, 5)], [0], [BLOCK_TABLE], BLOCK_SIZE, state_slots=[STATE_SLOT])
    assert batch.state_slot_ids == (STATE_SLOT,)
    with pytest.raises(ValueError, match="needs its state slots on the host"):
        with torch.inference_mode():
            model.forward(dataclasses.replace(batch, state_slot_ids=()), tiny.cache())


def test_a_decode_beside_a_prompt_chunk_takes_decodings_arithmetic(tiny, monkeypatch):
    """Sequence A (state slot 2, BLOCK_TABLE) decodes one token beside sequence B's 12-token prompt chunk (slot 0,
    blocks 1 and 3): the layers walk that step per sequence, and A's one token goes through the decode
    arithmetic (the verify ops, tests/kernels/test_deltanet.py: bit for bit the decode kernels'), not the
    chunked prefill's, so its recurrence does not change with what shares its step (nor, with speculation,
    with whether another sequence drafts). Its states match a decode-shaped step of A alone to fp32 rounding
    (the projections before them see another number of rows)."""
    if not tiny.cfg.linear_attention_layers:
        pytest.skip("no recurrent layers")
    model = tiny.model(tiny.resident())
    alone, beside = tiny.cache(), tiny.cache()
    prompt = _prompt(tiny.cfg, 20)
    _prefill(model, alone, [prompt])
    _prefill(model, beside, [prompt])
    chunked = []  # the chunked recurrence's calls: their token counts
    real = ops.gated_delta_rule_chunked
    monkeypatch.setattr(ops, "gated_delta_rule_chunked",
                        lambda q, *a, **kw: chunked.append(q.shape[0]) or real(q, *a, **kw))
    token = _prompt(tiny.cfg, 1, seed=9)
    with torch.inference_mode():
        model.forward(ForwardBatch.build([token], [20], [BLOCK_TABLE], BLOCK_SIZE, state_slots=[STATE_SLOT]), alone)
        mixed = ForwardBatch.build([token, _prompt(tiny.cfg, 12, seed=10)], [20, 0], [BLOCK_TABLE, [1, 3]], BLOCK_SIZE,
                                   state_slots=[STATE_SLOT, 0])
        assert not mixed.is_decode
        model.forward(mixed, beside)
    assert chunked == [12] * len(tiny.cfg.linear_attention_layers)  # B's chunk alone, in each layer
    for layer in tiny.cfg.linear_attention_layers:
        (conv, rec), (conv_ref, rec_ref) = beside.states.layer(layer), alone.states.layer(layer)
        assert _rel(rec[STATE_SLOT], rec_ref[STATE_SLOT]) < 1e-5 and _rel(conv[STATE_SLOT], conv_ref[STATE_SLOT]) < 1e-5
