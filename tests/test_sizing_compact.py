"""The budget's model facts follow compact bytes: each class names its formats (and the receipt names
the compact ones), the expert slot is the compact extent, and compact embeddings leave the activation
size to the final norm's dtype."""

from __future__ import annotations

import gguf

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
    lines = plan(Card.from_mib(1024), facts, Config(embedding_placement="vram")).lines()
    assert "weights lm_head: 0.02 MiB (tied to the embeddings: one copy, q8_0)" in lines
    assert "weights attention: 0.02 MiB (q4_0, q4_1, q8_0)" in lines and "weights norms: 0.00 MiB" in lines
