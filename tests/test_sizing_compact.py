"""The budget's model facts follow compact bytes: each class names its formats (and the receipt names
the compact ones), the expert slot is the compact extent, and compact embeddings leave the activation
size to the final norm's dtype."""

from __future__ import annotations

import gguf
import pytest
import torch

from radianced.budget import plan
from radianced.card import Card, MiB
from radianced.config import Config
from radianced.model.gguf import convert_gguf
from radianced.model.rad import RadFile
from radianced.sizing import ModelFacts
from tests.model.test_gguf_qwen3moe import write_qwen3moe_gguf

Q = gguf.GGMLQuantizationType


def test_compact_experts_set_the_slot_and_every_class_names_its_formats(tmp_path):
    src = write_qwen3moe_gguf(tmp_path / "m.gguf", stack_types=(Q.Q4_0, Q.Q4_0, Q.Q8_0))
    convert_gguf(src, tmp_path / "c.rad", None, compact=True)
    convert_gguf(src, tmp_path / "f.rad", None)
    with RadFile.open(tmp_path / "c.rad") as c, RadFile.open(tmp_path / "f.rad") as f:
        compact, full = ModelFacts.from_header(c.header), ModelFacts.from_header(f.header)
    inter, hidden = 32, 64
    q8_extent = 3 * inter * hidden // 32 * 34
    assert compact.expert_extent_bytes == q8_extent  # the widest compact extent
    assert full.expert_extent_bytes == 3 * inter * hidden * 4
    assert compact.expert_total_bytes == 4 * (2 * 3 * inter * hidden // 32 * 18 + q8_extent)
    assert compact.expert_formats == ("q4_0", "q8_0") and full.expert_formats == ("f32",)
    assert dict(compact.formats)["attention"] == ("f32",)
    assert compact.act_bytes == full.act_bytes == 4
    lines = plan(Card.from_mib(1024), compact, Config(placement="resident")).lines()
    assert any(line.startswith(f"expert slot: {q8_extent / MiB:.2f} MiB extent (q4_0: int4, an fp16 scale per 32; "
                               f"q8_0: int8, an fp16 scale per 32) -> ") for line in lines)
    full_lines = plan(Card.from_mib(1024), full, Config(placement="resident")).lines()
    assert not any("(f32" in line for line in full_lines)  # plain dtypes are not named: the receipt as before


def test_compact_embeddings_take_the_activation_size_from_the_final_norm(tmp_path):
    from tests.model.test_gguf_compact import QUANTIZED
    from tests.model.test_gguf import write_tiny_gguf

    src, _ = write_tiny_gguf(tmp_path / "t.gguf", types=QUANTIZED)
    convert_gguf(src, tmp_path / "c.rad", None, compact=True)
    with RadFile.open(tmp_path / "c.rad") as rad:
        facts = ModelFacts.from_header(rad.header)
        embed = rad.tensor_entry("model.embed_tokens.weight")
    assert facts.act_bytes == 4
    assert dict(facts.formats)["embeddings"] == ("q8_0",)
    assert facts.weight("embeddings") == embed.nbytes == embed.shape[0] * embed.shape[1] // 32 * 34
    lines = plan(Card.from_mib(1024, cuda=True), facts, Config(embedding_placement="vram")).lines()
    dense = embed.shape[0] * embed.shape[1] * 4  # on a card the table is dequantized at load (fp32 here)
    assert (f"weights lm_head: {dense / MiB:.2f} MiB (tied to the embeddings: one copy, q8_0, dequantized at load "
            "to the activations' dtype: the row gather reads dense rows)") in lines
    assert "weights attention: 0.02 MiB (q4_0, q4_1, q8_0)" in lines and "weights norms: 0.00 MiB" in lines


def _held_bytes(obj, seen: set[int]) -> int:
    """Bytes of every weight a loaded model holds (each object once): a compact matrix as its stored bytes,
    a dense tensor as itself."""
    from radianced.kernels.compact import CompactWeight, RowStack

    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, CompactWeight):
        return obj.data.nbytes
    if isinstance(obj, RowStack):
        return sum(_held_bytes(p, seen) for p in obj.parts)
    if isinstance(obj, dict):
        return sum(_held_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_held_bytes(v, seen) for v in obj)
    if type(obj).__module__.startswith("radianced.model.") and hasattr(obj, "__dict__"):
        return sum(_held_bytes(v, seen) for k, v in vars(obj).items() if k not in ("cfg", "placed"))
    return 0


def test_the_cpu_receipt_charges_what_the_host_backend_holds(tmp_path):
    """A compact GGUF on the CPU backend: every matrix held as stored (the block kernels read the file's
    bytes in place), the tied q8_0 table read by lookups and the lm_head alike. The receipt's weights are
    those bytes, and the loaded model holds exactly them; a GPU card's receipt keeps the stored bytes but
    for the table, dense there (tests/model/test_loader_compact.py holds the card's loader to it)."""
    from radianced.model.loader import load_model
    from tests.model.test_gguf import write_tiny_gguf
    from tests.model.test_gguf_compact import QUANTIZED

    src, _ = write_tiny_gguf(tmp_path / "t.gguf", types=QUANTIZED)
    convert_gguf(src, tmp_path / "c.rad", None, compact=True)
    with RadFile.open(tmp_path / "c.rad") as rad:
        facts = ModelFacts.from_header(rad.header)
        cpu = plan(Card.from_mib(1024), facts, Config())
        gpu = plan(Card.from_mib(1024, cuda=True), facts, Config(embedding_placement="vram"))
        model = load_model(rad, "cpu")
        held = _held_bytes(model, set())
        vocab, hidden = rad.model.vocab_size, rad.model.hidden_size
    assert held == cpu.weights_bytes + sum(p.bytes for p in cpu.host_weights)
    lm_head = {p.name: p for p in cpu.weights}["lm_head"]
    assert lm_head.bytes == facts.weight("embeddings") and "tied to the embeddings: one copy" in lm_head.detail
    assert held == sum(n for _, n in facts.weights)
    # stored bytes on a card, the tied table dequantized to fp32 (one copy for lookups and the lm_head)
    assert gpu.weights_bytes == sum(n for _, n in facts.weights) - facts.weight("embeddings") + vocab * hidden * 4
    assert cpu.weights_bytes < gpu.weights_bytes


@pytest.mark.parametrize("placement", ["ram", "vram"])
def test_a_card_charges_a_compact_table_dense_and_every_other_compact_matrix_as_stored(tmp_path, placement):
    """Untied: the q8_0 table is charged dense (fp32 here) where the flag puts it, the q4_1 lm_head and the
    q4_1 / q4_0 / q8_0 projections at their stored bytes, the experts' slot at the compact extent."""
    from tests.model.test_loader_compact import compact_qwen3moe

    with compact_qwen3moe(tmp_path) as rad:
        facts = ModelFacts.from_header(rad.header)
        stored = {t.name: t.nbytes for t in rad.header.tensors}
        extent = max(e.nbytes for e in rad.header.experts)
    table = facts.model.vocab_size * facts.model.hidden_size * 4
    assert dict(facts.card_weights) == {**dict(facts.weights), "embeddings": table}
    receipt = plan(Card.from_mib(1024, cuda=True), facts, Config(embedding_placement=placement))
    on_card = {p.name: p.bytes for p in receipt.weights}
    in_ram = {p.name: p.bytes for p in receipt.host_weights if p.name == "embeddings"}
    assert (in_ram if placement == "ram" else on_card)["embeddings"] == table
    assert "embeddings" not in (on_card if placement == "ram" else in_ram)
    assert on_card["lm_head"] == stored["lm_head.weight"]
    assert on_card["attention"] == sum(n for name, n in stored.items() if ".self_attn." in name and "norm" not in name)
    assert receipt.weights_bytes + sum(in_ram.values()) == sum(stored.values()) - stored["model.embed_tokens.weight"] \
        + table
    assert receipt.expert_extent == extent
    line = next(ln for ln in receipt.lines() if "embeddings:" in ln)
    assert line.endswith(f"(--embedding-placement {placement}, q8_0, dequantized at load to the activations' dtype: "
                         "the row gather reads dense rows)")


@pytest.mark.parametrize("stack_types, staged", [((Q.Q4_0, Q.Q4_0, Q.Q8_0), True), ((Q.Q4_1,) * 3, True),
                                                 ((Q.F32,) * 3, False)], ids=["q4_0+q8_0", "q4_1", "f32"])
def test_gguf_experts_with_a_host_pool_get_the_cards_miss_staging_rows(tmp_path, stack_types, staged):
    """kernels/stage.py's buffer: charged in the state on a CUDA card where GGUF experts may live in the host
    pool (a row an expert of a layer, up to MISS_STAGING_ROWS, each the widest extent in 16-byte words,
    one tensor as the caching allocator holds it); not for plain experts, under --placement resident,
    without a host pool or on the CPU."""
    from radianced.charges import MISS_STAGING_ROWS
    from radianced.sizing import allocator_tail

    src = write_qwen3moe_gguf(tmp_path / "m.gguf", stack_types=stack_types)
    convert_gguf(src, tmp_path / "c.rad", None, compact=True)
    with RadFile.open(tmp_path / "c.rad") as rad:
        facts = ModelFacts.from_header(rad.header)
    card = Card.from_mib(1024, cuda=True)
    receipt = plan(card, facts, Config(host_pool_mib=64))
    part = {p.name: p for p in receipt.state}.get("miss staging")
    if not staged:
        assert part is None and receipt.miss_staging == (0, 0)
        return
    rows, row = min(facts.experts_per_layer, MISS_STAGING_ROWS), (facts.expert_extent_bytes + 15) // 16 * 16
    assert receipt.miss_staging == (rows, row) and row % 16 == 0 and row >= facts.expert_extent_bytes
    assert part.bytes == rows * row + allocator_tail(rows * row)  # one tensor, as the caching allocator holds it
    assert f"state miss staging: {part.bytes / MiB:.2f} MiB ({rows} experts x {row / MiB:.2f} MiB" in \
        "\n".join(receipt.lines())
    for cfg, on in ((Config(host_pool_mib=64, placement="resident"), card), (Config(host_pool_mib=0), card),
                    (Config(host_pool_mib=64), Card.from_mib(1024))):
        other = plan(on, facts, cfg)
        assert other.miss_staging == (0, 0) and "miss staging" not in {p.name for p in other.state}
