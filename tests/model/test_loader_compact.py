"""A compact model in the form a CUDA card's kernels read (issue 20), checked on the CPU.

The tiny qwen3moe GGUF with Q8_0 / Q4_0 / Q4_1 expert stacks (one type per layer), q / k / v / o in
Q4_1 / Q4_0 / Q8_0 / Q4_0 (so [q | k | v] is a `RowStack` of three formats), a Q8_0 embedding table and a
Q4_1 lm_head, converted keeping its blocks:

- `device_weights` off the CPU keeps every compact matrix as its bytes (no CPU packing), the lm_head
  included, and makes the embedding table dense in the activations' dtype, equal to its dequantization;
- `_placed` moves a `CompactWeight`'s bytes and a `RowStack`'s parts, each once;
- that model, run by the Triton ops in the interpreter on the CPU, gives the reference ops' greedy
  tokens and logits within fp32 rounding (the GPU test, tests/gpu/test_compact_model_gpu.py, runs the
  same on the card);
- a format the Triton kernels do not read (a K-quant) is refused off the CPU, naming it and the fix;
- `load_model` on the meta device (a stand-in for the card: every copy shape-only) places exactly the
  bytes the CUDA receipt charges, on the card and in host RAM.
"""

from __future__ import annotations

import importlib

import gguf
import msgspec
import pytest
import torch

from radianced.budget import plan
from radianced.card import Card
from radianced.config import Config
from radianced.kernels import ops
from radianced.kernels.compact import CompactWeight, RowStack
from radianced.kv.cache import KVCache
from radianced.model.experts import ResidentExperts
from radianced.model.gguf import convert_gguf
from radianced.model.loader import (
    EMBEDDINGS, _place_attributes, build_model, device_weights, load_model, refuse_unread_formats,
)
from radianced.model.rad import RadFile
from radianced.model.rad_format import RadError
from radianced.sizing import ModelFacts
from tests.greedy import greedy_generate
from tests.model.test_gguf_qwen3moe import write_qwen3moe_gguf

Q = gguf.GGMLQuantizationType
LAYER_TYPES = {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q4_1, "attn_q.weight": Q.Q4_1,
               "attn_k.weight": Q.Q4_0, "attn_v.weight": Q.Q8_0, "attn_output.weight": Q.Q4_0}
PROMPTS = [[5, 9, 40, 41, 200, 7, 100, 12, 33], [3, 100, 250]]


def compact_qwen3moe(folder) -> RadFile:
    """The module docstring's model, converted keeping its blocks, opened."""
    src = write_qwen3moe_gguf(folder / "m.gguf", layer_types=LAYER_TYPES)
    convert_gguf(src, folder / "m.rad", None, compact=True)
    return RadFile.open(folder / "m.rad")


@pytest.fixture(scope="module")
def rad(tmp_path_factory):
    with compact_qwen3moe(tmp_path_factory.mktemp("compact_card")) as r:
        yield r


def test_off_the_cpu_compact_matrices_stay_bytes_and_the_table_is_dense(rad):
    card, cpu = device_weights(rad, "cuda"), device_weights(rad, "cpu")
    q = card("model.layers.0.self_attn.q_proj.weight")
    assert isinstance(q, CompactWeight) and q.fmt == "q4_1"
    on_cpu = cpu("model.layers.0.self_attn.q_proj.weight")  # the block kernels read the file's bytes in place
    assert isinstance(on_cpu, CompactWeight) and on_cpu.data.data_ptr() == q.data.data_ptr()
    head = card("lm_head.weight")
    assert isinstance(head, CompactWeight) and head.fmt == "q4_1"
    table = card(EMBEDDINGS)
    assert isinstance(table, torch.Tensor) and table.dtype == torch.float32  # the final norm's dtype
    assert torch.equal(table, rad.tensor(EMBEDDINGS).dequantize())
    assert card(EMBEDDINGS).dtype == torch.float32 and device_weights(rad, "cuda", torch.bfloat16)(
        EMBEDDINGS).dtype == torch.bfloat16


def test_placing_moves_compact_bytes_and_row_stack_parts_once(rad):
    model = build_model(rad.model, device_weights(rad, "cuda"), ResidentExperts.from_rad(rad))
    moved: dict[int, torch.Tensor] = {}

    def place(t: torch.Tensor) -> torch.Tensor:
        assert id(t) not in moved, "a tensor placed twice"
        moved[id(t)] = t.to("meta")
        return moved[id(t)]

    before = model.layers[0].attn.wqkv
    _place_attributes(model, place)
    wqkv, wo = model.layers[0].attn.wqkv, model.layers[0].attn.wo
    assert isinstance(before, RowStack) and isinstance(wqkv, RowStack)
    assert [p.fmt for p in wqkv.parts] == ["q4_1", "q4_0", "q8_0"]
    assert all(p.device.type == "meta" and p.shape == b.shape for p, b in zip(wqkv.parts, before.parts))
    assert isinstance(wo, CompactWeight) and wo.device.type == "meta" and wo.fmt == "q4_0"
    assert model.lm_head.weight.device.type == "meta" and model.embed.weight.device.type == "meta"
    stored = sum(t.nbytes for t in rad.header.tensors if t.name != EMBEDDINGS)
    table = rad.model.vocab_size * rad.model.hidden_size * 4
    assert sum(t.nbytes for t in moved.values()) == stored + table


@pytest.fixture
def triton_ops():
    """The Triton op set bound on the CPU, its kernels run by the interpreter; the CPU's set after."""
    import tests.kernels.interpreter as interp  # TRITON_INTERPRET before triton's import
    from radianced.kernels import linear

    interp.require_interpreted(linear._linear_kernel, "linear")
    ops.select("cpu", oracle=True)  # every name the reference first: the ones Triton leaves
    for module, name in ops._TRITON:
        setattr(ops, name, getattr(importlib.import_module(f"radianced.kernels.{module}"), name))
    yield
    ops.select("cpu")


def _greedy(rad, model, steps: int):
    cache = KVCache.allocate(rad.model, num_blocks=8, block_size=16, num_state_slots=len(PROMPTS),
                             dtype=torch.float32)
    return greedy_generate(model, cache, PROMPTS, steps)


def test_the_card_form_under_the_triton_ops_matches_the_reference(rad, triton_ops):
    """Measured: logits within 7.1e-7 of max |logit| over 4 steps; 4 s in the interpreter."""
    model = build_model(rad.model, device_weights(rad, "cuda"), ResidentExperts.from_rad(rad))
    ours = _greedy(rad, model, 4)
    ops.select("cpu", oracle=True)
    want = _greedy(rad, model, 4)  # the same objects, dequantized per use by the reference ops
    assert ours.tokens == want.tokens
    for got, ref in zip(ours.logits, want.logits):
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


def _with_format(rad, name: str, fmt: str):
    """`rad`'s path and header with tensor `name` recorded as `fmt` (what refuse_unread_formats reads)."""
    tensors = [msgspec.structs.replace(t, dtype=fmt) if t.name == name else t for t in rad.header.tensors]
    return type("Rad", (), {"path": rad.path, "header": msgspec.structs.replace(rad.header, tensors=tensors)})


def test_formats_the_triton_kernels_do_not_read_are_refused_off_the_cpu(rad):
    refuse_unread_formats(rad, "cuda")  # q8_0, q4_0, q4_1: read on the card
    k_quant = _with_format(rad, "model.layers.1.self_attn.o_proj.weight", "q6_k")
    with pytest.raises(RadError, match=r"o_proj.weight: stored as q6_k .*--quantize experts=int4,layers=int8"):
        refuse_unread_formats(k_quant, "cuda")
    refuse_unread_formats(k_quant, "cpu")  # the CPU reads every format
    refuse_unread_formats(_with_format(rad, EMBEDDINGS, "q4_k"), "cuda")  # a table is made dense at load
    experts = [msgspec.structs.replace(e, dtype="q4_k+q6_k") if e.layer == 2 else e for e in rad.header.experts]
    mixed = type("Rad", (), {"path": rad.path, "header": msgspec.structs.replace(rad.header, experts=experts)})
    with pytest.raises(RadError, match=r"routed experts of layer 2: stored as q4_k\+q6_k .* in q4_k, q6_k\)"):
        refuse_unread_formats(mixed, "cuda")


@pytest.mark.parametrize("placement", ["ram", "vram"])
def test_load_model_on_a_card_places_what_the_receipt_charges(rad, placement):
    model = load_model(rad, "meta", embedding_placement=placement)
    receipt = plan(Card.from_mib(1024, cuda=True), ModelFacts.from_header(rad.header),
                   Config(embedding_placement=placement))
    host = sum(p.bytes for p in receipt.host_weights if p.name == "embeddings")
    assert (model.placed.device_bytes, model.placed.host_bytes) == (receipt.weights_bytes, host)
    assert host == (rad.model.vocab_size * rad.model.hidden_size * 4 if placement == "ram" else 0)
    assert model.embed.weight.device.type == ("cpu" if placement == "ram" else "meta")
    assert isinstance(model.lm_head.weight, CompactWeight) and model.lm_head.weight.device.type == "meta"
    slab = model.layers[0].mlp.experts.slab
    assert slab.device.type == "meta" and slab.dtype == torch.uint8 and slab.shape[1] % 16 == 0
