"""The MTP head against an oracle built from transformers' own pieces.

transformers has no MTP, so the oracle assembles the published math (model/mtp.py) from
transformers' Qwen3-Next decoder layer, RMSNorm and rotary embedding, loaded with the tiny
model's random `mtp.*` weights: for every position p of a prompt,
fc([norm_e(embed(t_{p+1})) ; norm_h(h_p)]) -> decoder layer (causal over the prompt) -> norm ->
lm_head, with h the main model's final-normed hidden states. Ours runs the same prompt through
`load_model(mtp=True)` over a paged KV cache with the MTP layer as one more layer.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from radianced.kv.cache import KVCache
from radianced.model.batch import ForwardBatch
from radianced.model.convert import convert
from radianced.model.loader import load_model, load_plan
from radianced.model.rad import RadFile
from radianced.model.rad_format import RadError
from radianced.model.tiny import make_tiny

BLOCK = 16


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    src = make_tiny("qwen3_next", tmp_path_factory.mktemp("mtp"), mtp_layers=1)
    convert(src, src / "model.rad")
    return src, RadFile.open(src / "model.rad")


def _oracle_logits(src, ids: list[int]) -> torch.Tensor:
    from transformers import Qwen3NextForCausalLM
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

    hf = Qwen3NextForCausalLM.from_pretrained(src, torch_dtype=torch.float32).eval()
    cfg = hf.config
    w = load_file(src / "mtp.safetensors")
    layer = Qwen3NextDecoderLayer(cfg, cfg.layer_types.index("full_attention")).eval()
    layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in w.items() if k.startswith("mtp.layers.0.")})
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = Qwen3NextRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        norms[name].weight.data.copy_(w[f"mtp.{name}.weight"])
    with torch.no_grad():
        t = torch.tensor([ids])
        h = hf.model(t).last_hidden_state[:, :-1]  # positions 0 .. T-2, final-normed
        e = hf.model.embed_tokens(t[:, 1:])  # the token after each
        x = torch.cat((norms["pre_fc_norm_embedding"](e), norms["pre_fc_norm_hidden"](h)), -1) @ w["mtp.fc.weight"].T
        positions = torch.arange(len(ids) - 1)[None]
        causal = torch.full((len(ids) - 1, len(ids) - 1), float("-inf")).triu(1)[None, None]
        x = layer(x, hf.model.rotary_emb(x, positions), attention_mask=causal, position_ids=positions)
        return hf.lm_head(norms["norm"](x))[0]


def mtp_pass(rad: RadFile, ids: list[int], next_ids: list[int]):
    """One prefill of the main model over `ids` (positions 0..) and the MTP head over its rows, row p
    reading next_ids[p], on a fresh fp32 cache that pages the MTP layer as one more attention layer (a block
    to spare past the ids, for a chained step). Returns (model, cache, block table, the head's x [T, H])."""
    model = load_model(rad, mtp=True)
    m = rad.model
    blocks = len(ids) // BLOCK + 1
    states = KVCache.allocate(m, num_blocks=1, block_size=BLOCK, num_state_slots=1, dtype=torch.float32).states
    layers = len(m.full_attention_layers) + 1
    cache = KVCache(torch.zeros((blocks, 1, layers, 2, BLOCK, m.num_key_value_heads, m.head_dim)),
                    m.full_attention_layers + (m.num_hidden_layers,), states)
    table = list(range(blocks))
    batch = ForwardBatch.build([ids], [0], [table], BLOCK, logits="all", state_slots=[0])
    with torch.inference_mode():
        _, hidden = model.forward(batch, cache, hidden=True)
        x = model.mtp(torch.tensor(next_ids), hidden, model.rotary.at(batch.positions), batch, cache)
    return model, cache, table, x


def _ours(rad: RadFile, ids: list[int]) -> torch.Tensor:
    model, _, _, x = mtp_pass(rad, ids[:-1], ids[1:])
    with torch.inference_mode():
        return model.mtp.logits(x)


def test_the_mtp_heads_draft_logits_are_the_published_math_over_transformers_pieces(tiny_mtp):
    src, rad = tiny_mtp
    ids = torch.randint(0, rad.model.vocab_size - 3, (37,), generator=torch.Generator().manual_seed(5)).tolist()
    ours, want = _ours(rad, ids), _oracle_logits(src, ids)
    assert ours.shape == want.shape == (36, rad.model.vocab_size)
    assert (ours - want).abs().max() <= 1e-4 * want.abs().max()
    assert torch.equal(ours.argmax(-1), want.argmax(-1))


def test_the_mtp_head_is_loaded_only_where_it_drafts_and_only_for_a_model_that_has_one(tiny_mtp, tmp_path):
    _, rad = tiny_mtp
    with_mtp, without = load_plan(rad, mtp=True).device, load_plan(rad).device
    assert {n for n in with_mtp if n.startswith("mtp.")} == {t.name for t in rad.header.tensors
                                                              if t.name.startswith("mtp.")}
    assert not any(n.startswith("mtp.") for n in without)
    assert load_model(rad).mtp is None
    plain = make_tiny("qwen3_next", tmp_path)
    convert(plain, plain / "model.rad")
    with pytest.raises(RadError, match="has no MTP layers: draft with --speculative-method ngram"):
        load_model(RadFile.open(plain / "model.rad"), mtp=True)
