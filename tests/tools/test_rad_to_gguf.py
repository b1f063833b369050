"""tools/rad_to_gguf.py: a synthetic qwen3_moe `.rad` as llama.cpp's qwen3moe GGUF, read back with the gguf
package's own reader: llama.cpp's names and hyperparameters, every expert stacked where llama.cpp looks for
it, the values the `.rad`'s (F16 matrices, F32 norms); a model it cannot write is refused by name."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from radianced.model.rad import RadFile
from tools.make_synthetic import make_synthetic
from tools.rad_to_gguf import NotConvertible, write

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    rad = RadFile.open(make_synthetic(tmp / "m.rad", layers=2, zipf=1.0, vocab=2048, narrow=16, progress=False))
    out = tmp / "m.gguf"
    n = write(rad, out)
    yield rad, gguf.GGUFReader(str(out)), n
    rad.close()


def _array(t) -> np.ndarray:
    """A reader tensor as numpy in the writer's (row-major) shape."""
    return np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)])


def test_hyperparameters_and_names_are_llama_cpps_qwen3moe(converted):
    rad, r, n = converted
    m = rad.model
    def value(key):
        return r.fields[key].contents()

    assert value("general.architecture") == "qwen3moe" and value("tokenizer.ggml.model") == "none"
    assert value("qwen3moe.block_count") == m.num_hidden_layers == 2
    assert value("qwen3moe.expert_count") == m.num_experts
    assert value("qwen3moe.expert_used_count") == m.num_experts_per_tok
    assert value("qwen3moe.expert_feed_forward_length") == m.moe_intermediate_size
    assert value("qwen3moe.vocab_size") == m.vocab_size
    names = {t.name for t in r.tensors}
    per_layer = {"attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                 "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}
    assert names == {"token_embd.weight", "output.weight", "output_norm.weight"} | {
        f"blk.{i}.{p}.weight" for i in range(2) for p in per_layer} and len(names) == n


def test_values_are_the_rads_with_every_expert_where_llama_cpp_reads_it(converted):
    rad, r, _ = converted
    t = {x.name: x for x in r.tensors}
    assert t["blk.1.attn_norm.weight"].tensor_type == Q.F32 and t["blk.1.attn_q.weight"].tensor_type == Q.F16
    norm = rad.tensor("model.layers.1.input_layernorm.weight").float().numpy()
    assert np.array_equal(_array(t["blk.1.attn_norm.weight"]), norm)
    q = rad.tensor("model.layers.1.self_attn.q_proj.weight").to(torch.float16).numpy()
    assert np.array_equal(_array(t["blk.1.attn_q.weight"]), q)
    gate, up, down = (_array(t[f"blk.1.ffn_{p}_exps.weight"]) for p in ("gate", "up", "down"))
    for e in (0, 5, rad.model.num_experts - 1):
        g, u, d = (x.to(torch.float16).numpy() for x in rad.expert(1, e))
        assert np.array_equal(gate[e], g) and np.array_equal(up[e], u) and np.array_equal(down[e], d)


def test_a_model_it_cannot_write_is_refused_naming_it(tmp_path):
    rad = RadFile.open(make_synthetic(tmp_path / "next.rad", shape="qwen3-next-80b-a3b", layers=4, vocab=2048,
                                      narrow=16, progress=False))
    try:
        with pytest.raises(NotConvertible, match="a qwen3_next model; this writes qwen3_moe"):
            write(rad, tmp_path / "next.gguf")
    finally:
        rad.close()
