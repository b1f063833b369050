"""A qwen3_moe `.rad` (a synthetic one: tools/make_synthetic.py) as a GGUF llama.cpp loads: issue 24's
llama.cpp peer runs the same weights radianced runs.

    python tools/rad_to_gguf.py IN.rad OUT.gguf

Names and stacking are llama.cpp's `qwen3moe` (its convert_hf_to_gguf.py writes a Qwen3-MoE checkpoint
so): `blk.N.attn_q.weight`, ..., each layer's routed experts stacked as `ffn_gate_exps` / `ffn_up_exps`
[experts, intermediate, hidden] and `ffn_down_exps` [experts, hidden, intermediate]. The matrices are
F16 (the `.rad`'s bf16 values, 2 bytes a weight as radianced reads them; a synthetic model's weights are
small, so nothing overflows), the norms F32. There is no tokenizer: `tokenizer.ggml.model` is "none" with
the vocabulary's size, and llama-bench feeds random token ids. The file is written tensor by tensor (one
layer's experts in memory at a time). A float `.rad` only: a compact one's blocks are radianced's own.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radianced.model.rad import RadFile  # noqa: E402

ARCH = "qwen3moe"
TOP = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}  # untied: output
LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
         "mlp.gate.weight": "ffn_gate_inp.weight"}


def gguf_dtype(shape: tuple[int, ...]) -> np.dtype:
    """What a tensor of `shape` is written as: F32 a vector (a norm), F16 a matrix or an expert stack."""
    return np.dtype(np.float32 if len(shape) == 1 else np.float16)


class NotConvertible(ValueError):
    """The `.rad` is not a float qwen3_moe model."""


def plan(rad: RadFile) -> Iterator[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]:
    """(GGUF name, shape, a function giving its array) for every tensor, in the file's order."""
    m = rad.model
    if m.family != "qwen3_moe":
        raise NotConvertible(f"{rad.path}: a {m.family} model; this writes qwen3_moe (llama.cpp's qwen3moe) only")

    def array(name: str) -> Callable[[], np.ndarray]:
        def get() -> np.ndarray:
            t = rad.tensor(name)
            if not isinstance(t, torch.Tensor):
                raise NotConvertible(f"{rad.path}: {name} is compact ({rad.tensor_entry(name).dtype}); convert a "
                                     "float .rad (make_synthetic.py without --quantize)")
            return t.float().numpy() if t.dim() == 1 else t.to(torch.float16).numpy()
        return get

    def experts(layer: int, piece: int) -> Callable[[], np.ndarray]:
        def get() -> np.ndarray:
            parts = [rad.expert(layer, e)[piece] for e in range(m.num_experts)]
            if not all(isinstance(p, torch.Tensor) for p in parts):
                raise NotConvertible(f"{rad.path}: layer {layer}'s experts are compact; convert a float .rad")
            return torch.stack(parts).to(torch.float16).numpy()
        return get

    names = set(rad.tensor_names())
    for hf, name in TOP.items():
        if hf in names:
            yield name, rad.tensor_entry(hf).shape, array(hf)
    i_, h = m.moe_intermediate_size, m.hidden_size
    for layer in range(m.num_hidden_layers):
        for hf, name in LAYER.items():
            full = f"model.layers.{layer}.{hf}"
            yield f"blk.{layer}.{name}", rad.tensor_entry(full).shape, array(full)
        for piece, (name, shape) in enumerate((("ffn_gate_exps", (m.num_experts, i_, h)),
                                               ("ffn_up_exps", (m.num_experts, i_, h)),
                                               ("ffn_down_exps", (m.num_experts, h, i_)))):
            yield f"blk.{layer}.{name}.weight", shape, experts(layer, piece)
    yield "output_norm.weight", rad.tensor_entry("model.norm.weight").shape, array("model.norm.weight")


def write(rad: RadFile, out: Path) -> int:
    """Write `out`; how many tensors."""
    m = rad.model
    w = gguf.GGUFWriter(str(out), ARCH)
    w.add_block_count(m.num_hidden_layers)
    w.add_context_length(m.max_position_embeddings)
    w.add_embedding_length(m.hidden_size)
    w.add_feed_forward_length(m.intermediate_size)
    w.add_head_count(m.num_attention_heads)
    w.add_head_count_kv(m.num_key_value_heads)
    w.add_key_length(m.head_dim)
    w.add_value_length(m.head_dim)
    w.add_layer_norm_rms_eps(m.rms_norm_eps)
    w.add_rope_freq_base(m.rope_theta)
    w.add_expert_count(m.num_experts)
    w.add_expert_used_count(m.num_experts_per_tok)
    w.add_expert_feed_forward_length(m.moe_intermediate_size)
    w.add_vocab_size(m.vocab_size)
    w.add_tokenizer_model("none")
    tensors = list(plan(rad))
    for name, shape, _ in tensors:
        dtype = gguf_dtype(shape)
        w.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, get in tensors:
        data = get()
        if tuple(data.shape) != tuple(shape):
            raise NotConvertible(f"{name}: {tuple(data.shape)}, expected {tuple(shape)}")
        w.write_tensor_data(data)
    w.close()
    return len(tensors)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rad", type=Path)
    ap.add_argument("out", type=Path)
    a = ap.parse_args()
    rad = RadFile.open(a.rad)
    try:
        n = write(rad, a.out)
    except NotConvertible as e:
        print(f"rad_to_gguf: {e}", file=sys.stderr)
        return 2
    finally:
        rad.close()
    print(f"rad_to_gguf: {a.out}: {n} tensors, {a.out.stat().st_size / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
