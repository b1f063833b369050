"""The peer of tools/bench_peer_offload.py: Hugging Face transformers with accelerate's offload.

`hf_config` spells a radianced ModelConfig as transformers' Qwen3MoeConfig; `load_offloaded`
is the load people reach for when the model is larger than the card (`from_pretrained` with
`device_map="auto"` and `max_memory`), and says where accelerate put the model; `greedy` is a
greedy decode loop over transformers' DynamicCache, timed per forward.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Callable

import torch


def hf_config(m):
    """The transformers config of radianced's ModelConfig `m` (Qwen3-MoE, every layer routed; a model with no
    dense MLP gets a nominal intermediate size of 1). tools/bench_model.py builds its peer from it too."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size or 1,
        num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim, hidden_act="silu",
        max_position_embeddings=m.max_position_embeddings, rms_norm_eps=m.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta}, num_experts=m.num_experts,
        num_experts_per_tok=m.num_experts_per_tok, moe_intermediate_size=m.moe_intermediate_size,
        norm_topk_prob=m.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
        attention_bias=False, use_cache=True, bos_token_id=m.bos_token_id, eos_token_id=list(m.eos_token_ids))


def load_offloaded(folder: Path, max_memory: dict) -> tuple[torch.nn.Module, dict]:
    """(model, facts): `folder` loaded in bf16 with device_map="auto" under `max_memory` (device -> bytes;
    what fits nowhere goes to `folder`/offload on disk). facts: versions, load seconds, placement."""
    import accelerate
    import transformers
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, device_map="auto", max_memory=max_memory,
                                                 dtype=torch.bfloat16, offload_folder=str(folder / "offload")).eval()
    return model, {"transformers": transformers.__version__, "accelerate": accelerate.__version__,
                   "max_memory": {_device_name(k): v for k, v in max_memory.items()},
                   "load_s": time.perf_counter() - t0, "placement": placement(model),
                   "attn_implementation": model.config._attn_implementation,
                   "experts_implementation": getattr(model.config, "_experts_implementation", None)}


def placement(model) -> dict:
    """Where accelerate put the model: bytes and decoder layers per device of its device map."""
    dm = model.hf_device_map
    keys = sorted(dm, key=len, reverse=True)  # the longest entry that names a parameter's module wins

    def device_of(name: str) -> str:
        return _device_name(dm[next(k for k in keys if k == "" or name == k or name.startswith(k + "."))])

    nbytes: dict[str, int] = {}
    for name, p in model.named_parameters():  # offloaded ones are on "meta" and still sized
        dev = device_of(name)
        nbytes[dev] = nbytes.get(dev, 0) + p.numel() * p.element_size()
    layers: dict[str, int] = {}
    for i in range(model.config.num_hidden_layers):
        dev = device_of(f"model.layers.{i}.")
        layers[dev] = layers.get(dev, 0) + 1
    return {"bytes": nbytes, "layers": layers, "device_map_entries": len(dm)}


def _device_name(d) -> str:
    return f"cuda:{d}" if isinstance(d, int) else str(d)


def greedy(model, prompts: list[list[int]], tokens: int, device: str, stop: Callable[[], bool]):
    """The prompts (equal lengths) decoded together, greedily: the prefill, then one forward per token
    until each sequence has `tokens` or `stop()` says so (after at least two timed steps).
    Returns (tokens per sequence, seconds to the first tokens on the host, seconds of each later step)."""
    from transformers import DynamicCache

    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated")  # `cache=` is new in 5.24
    ids = torch.tensor(prompts, device=device)
    cache = DynamicCache(config=model.config)
    got: list[list[int]] = [[] for _ in prompts]
    steps: list[float] = []
    with torch.inference_mode():
        t0 = time.perf_counter()
        nxt = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1)
        for g, t in zip(got, nxt.tolist()):  # tolist: the host sync a server makes to send the token
            g.append(t)
        ttft = time.perf_counter() - t0
        while len(got[0]) < tokens and not (len(steps) >= 2 and stop()):
            ts = time.perf_counter()
            logits = model(input_ids=nxt[:, None].to(device), past_key_values=cache, use_cache=True).logits
            nxt = logits[:, -1].argmax(-1)
            for g, t in zip(got, nxt.tolist()):
                g.append(t)
            steps.append(time.perf_counter() - ts)
    return got, ttft, steps
