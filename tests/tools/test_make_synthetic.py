"""tools/make_synthetic.py: real shapes, a loadable model, and the router skew it promises.

Files are written at width / 16 (`narrow=16`: hidden 128, experts and top-k as
the real models) with 2 layers and a small vocabulary, so the CPU writes and
runs them in seconds. The routing histogram is measured through the real model
(`load_model` + a forward over random prompts) with an expert source that counts.
"""

from __future__ import annotations

import math

import pytest
import torch

from radianced.kv.cache import KVCache
from radianced.model.batch import ForwardBatch
from radianced.model.experts import ResidentExperts
from radianced.model.loader import load_model
from radianced.model.rad import RadFile
from radianced.model.tokenizer import Tokenizer
from radianced.model.quantize import quantize
from tools.make_synthetic import SyntheticError, make_synthetic, shape_config, zipf_targets

BLOCK = 16


class CountingExperts(ResidentExperts):
    """Every expert resident; counts each layer's token-to-expert assignments."""

    def __init__(self, rad: RadFile):
        base = ResidentExperts.from_rad(rad)
        super().__init__(base.slab, base._tables, base._formats)
        self.num_experts = rad.model.num_experts
        self.counts: dict[int, torch.Tensor] = {}

    def prepare(self, layer: int, expert_ids: torch.Tensor) -> None:
        c = torch.bincount(expert_ids.flatten(), minlength=self.num_experts)
        self.counts[layer] = self.counts.get(layer, 0) + c


def forward(rad: RadFile, seqs: int, tokens: int, seed: int = 0, experts=None) -> torch.Tensor:
    """Logits [seqs, V] of random prompts, prefilled together."""
    m = rad.model
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, m.vocab_size, (tokens,), generator=g).tolist() for _ in range(seqs)]
    nb = -(-tokens // BLOCK)
    dtype = rad.tensor("model.embed_tokens.weight", verify=False).dtype
    cache = KVCache.allocate(m, seqs * nb, BLOCK, seqs, dtype)
    batch = ForwardBatch.build(prompts, [0] * seqs, [list(range(b * nb, (b + 1) * nb)) for b in range(seqs)], BLOCK,
                               state_slots=list(range(seqs)) if m.linear_attention_layers else None)
    with torch.inference_mode():
        return load_model(rad, experts=experts).forward(batch, cache)


def shares(counts: torch.Tensor) -> torch.Tensor:
    """Each expert's share of the tokens that chose it, most popular first: sums to top_k."""
    return counts.sort(descending=True).values.float()


@pytest.fixture(scope="module")
def moe_rads(tmp_path_factory):
    """qwen3-30b-a3b at width / 16, 2 layers, vocab 2048, fp32 (fast on the CPU): zipf 0 and 1.2."""
    tmp = tmp_path_factory.mktemp("synthetic")
    return {z: RadFile.open(make_synthetic(tmp / f"z{z}.rad", layers=2, zipf=z, vocab=2048, narrow=16, dtype="f32",
                                           progress=False)) for z in (0.0, 1.2)}


def test_the_real_configs_are_the_released_models():
    a = shape_config("qwen3-30b-a3b", 48)
    assert (a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim) == (2048, 32, 4, 128)
    assert (a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size, a.vocab_size) == (128, 8, 768, 151936)
    assert a.rope_theta == 1e6 and a.norm_topk_prob and a.moe_layers == tuple(range(48))
    n = shape_config("qwen3-next-80b-a3b", 48)
    assert n.full_attention_layers == tuple(range(3, 48, 4)) and len(n.linear_attention_layers) == 36
    assert (n.num_attention_heads, n.num_key_value_heads, n.head_dim, n.rotary_dim) == (16, 2, 256, 64)
    assert (n.num_experts, n.num_experts_per_tok, n.moe_intermediate_size, n.shared_expert_intermediate_size) \
        == (512, 10, 512, 512)
    assert (n.linear_num_key_heads, n.linear_num_value_heads, n.linear_key_head_dim, n.linear_value_head_dim,
            n.linear_conv_kernel_dim) == (16, 32, 128, 128, 4)
    assert shape_config("qwen3-next-80b-a3b", 2).layer_types == ("linear_attention", "full_attention")


def test_the_file_is_a_synthetic_rad_with_every_tensor_and_a_tokenizer_for_every_id(moe_rads):
    rad = moe_rads[1.2]
    rad.verify()
    h = rad.header
    assert h.synthetic and "2 of 48 layers" in h.source and "width / 16" in h.source
    m = rad.model
    assert (m.hidden_size, m.num_attention_heads, m.num_key_value_heads, m.moe_intermediate_size) == (128, 8, 1, 48)
    assert len(h.experts) == 2 * 128 and {(e.intermediate, e.hidden) for e in h.experts} == {(48, 128)}
    assert rad.tensor("model.layers.1.self_attn.q_proj.weight").shape == (8 * 128, 128)
    tok = Tokenizer.from_header(h)
    assert tok.vocab_size == m.vocab_size == 2048
    assert tok.decode([m.vocab_size - 1]) == "<|synthetic_2047|>"
    assert tok.eos_token_ids == m.eos_token_ids and tok.encode("<|im_end|>") == [m.eos_token_ids[0]]


def test_weights_have_a_trained_models_scale(moe_rads):
    rad = moe_rads[0.0]
    q = rad.tensor("model.layers.0.self_attn.q_proj.weight")
    assert 0.018 < float(q.std()) < 0.022
    norm = rad.tensor("model.layers.0.input_layernorm.weight")
    assert (norm - 1).abs().max() < 0.15


def test_zipf_skew_is_what_the_model_routes(moe_rads):
    """16 random prompts of 128 tokens: each layer's histogram is the fitted target's."""
    m = moe_rads[1.2].model
    experts = CountingExperts(moe_rads[1.2])
    forward(moe_rads[1.2], 16, 128, experts=experts)
    ranks = torch.arange(1, m.num_experts + 1)
    target = zipf_targets(m.num_experts, m.num_experts_per_tok, 1.2, ranks)  # sorted, most popular first
    top = math.ceil(0.2 * m.num_experts)
    for layer, counts in experts.counts.items():
        share = shares(counts) / (16 * 128)
        assert float(share[:top].sum() / m.num_experts_per_tok) > 0.7, f"layer {layer}"  # target 0.77
        assert 0.5 * float((share - target).abs().sum()) / m.num_experts_per_tok < 0.05, f"layer {layer}"


def test_zipf_zero_routes_uniformly(moe_rads):
    experts = CountingExperts(moe_rads[0.0])
    forward(moe_rads[0.0], 16, 128, experts=experts)
    for layer, counts in experts.counts.items():
        rel = counts.float() / counts.float().mean()
        assert 0.6 < float(rel.min()) and float(rel.max()) < 1.5, f"layer {layer}: {rel}"


def test_qwen3_next_loads_runs_in_bf16_and_is_skewed(tmp_path):
    rad = RadFile.open(make_synthetic(tmp_path / "next.rad", shape="qwen3-next-80b-a3b", layers=2, zipf=1.2,
                                      vocab=512, narrow=16, progress=False))
    assert rad.model.layer_types == ("linear_attention", "full_attention")
    experts = CountingExperts(rad)
    logits = forward(rad, 4, 32, experts=experts)
    assert logits.shape == (4, 512) and torch.isfinite(logits).all() and float(logits.std()) > 0
    for layer, counts in experts.counts.items():
        share = shares(counts) / (4 * 32)
        assert float(share[:math.ceil(0.2 * 512)].sum() / 10) > 0.6, f"layer {layer}"  # target 0.84


def test_the_same_arguments_write_the_same_bytes(tmp_path):
    a, b = (make_synthetic(tmp_path / f"{n}.rad", layers=1, vocab=512, narrow=16, zipf=0.5, progress=False)
            for n in "ab")
    assert a.read_bytes() == b.read_bytes()


def test_zipf_targets_sum_to_top_k_and_saturate_at_one():
    p = zipf_targets(128, 8, 1.2, torch.arange(1, 129))
    assert abs(float(p.sum()) - 8) < 1e-4 and float(p.max()) <= 1.0 and bool((p[:-1] >= p[1:]).all())
    assert float(p[0]) == 1.0 and float(p[-1]) < 0.01
    assert torch.allclose(zipf_targets(128, 8, 0.0, torch.arange(1, 129)), torch.full((128,), 1 / 16))


@pytest.mark.parametrize("kwargs, words", [
    (dict(shape="llama-3"), "unknown shape"),
    (dict(narrow=3), "narrow 3"),
    (dict(vocab=300), "vocab 300"),
    (dict(dtype="f8_e4m3"), "dtype"),
    (dict(zipf=-1), "zipf"),
])
def test_bad_arguments_are_refused_by_name(tmp_path, kwargs, words):
    with pytest.raises(SyntheticError, match=words):
        make_synthetic(tmp_path / "x.rad", layers=1, **kwargs)
    assert not (tmp_path / "x.rad").exists()


def test_compact_twin_is_the_float_model_rounded(tmp_path):
    """--quantize experts=int4,layers=fp8: the same random tensors as the float model of the same seed, quantized
    (model/quantize.py), and the same routing: the rows D stay zero, so every token picks the same experts."""
    kw = dict(layers=2, zipf=1.2, vocab=1024, narrow=8, dtype="f32", progress=False)
    plain = RadFile.open(make_synthetic(tmp_path / "f32.rad", **kw))
    compact = RadFile.open(make_synthetic(tmp_path / "q.rad", quantize="experts=int4,layers=fp8", **kw))
    assert {e.dtype for e in compact.header.experts} == {"q4_0"}
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert compact.tensor_entry(q_proj).dtype == "fp8_b128"
    assert compact.tensor_entry("model.layers.0.mlp.gate.weight").dtype == "f32"  # the router as it is
    assert torch.equal(compact.tensor(q_proj).data, quantize(plain.tensor(q_proj), "fp8_b128").data)
    for got, want in zip(compact.expert(1, 5), plain.expert(1, 5)):
        assert torch.equal(got.data, quantize(want, "q4_0").data)
    counted = [CountingExperts(r) for r in (plain, compact)]
    for rad, experts in zip((plain, compact), counted):
        forward(rad, 4, 32, experts=experts)
    for layer in counted[0].counts:
        assert torch.equal(counted[0].counts[layer], counted[1].counts[layer]), f"layer {layer}"


def test_compact_experts_need_whole_blocks(tmp_path):
    with pytest.raises(SyntheticError, match="narrow 16"):
        make_synthetic(tmp_path / "x.rad", layers=1, narrow=16, quantize="experts=int4")
    with pytest.raises(SyntheticError, match="embeddings"):
        make_synthetic(tmp_path / "x.rad", layers=1, narrow=8, quantize="embeddings=int8")
