"""Tiny random Hugging Face checkpoints, the oracle's side of every model test.

`make_tiny(family, out_dir)` writes a complete checkpoint directory that
`transformers` loads as it would a real one (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json with a ChatML
template), small enough to build and run in well under a second.

The weights are what transformers initialises, then perturbed so that no
parameter sits at a value that hides a bug: RMSNorm weights are not 1 (or 0 for
Qwen3-Next's zero-centred norms), the DeltaNet decays are in a range where the
state neither vanishes nor is kept whole, and any bias is non-zero. The
tokenizer is a byte-level BPE trained on generated text, with Qwen's special
tokens appended at the top of the vocabulary.

Everything is a function of `family`, `seed` and the overrides: two calls with
the same arguments write byte-identical files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

FAMILIES = ("llama", "qwen3_moe", "qwen3_next")

VOCAB_SIZE = 400  # 256 bytes + 141 merges + 3 special tokens; not a multiple of 64 on purpose
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # Qwen's order, ids VOCAB_SIZE-3 ..
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = VOCAB_SIZE - 3, VOCAB_SIZE - 2, VOCAB_SIZE - 1

DEFAULT_LAYER_TYPES = ("linear_attention", "full_attention", "linear_attention", "full_attention")

# ChatML as Qwen3 writes it, without tools or thinking.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    hidden_act="silu",
    max_position_embeddings=4096,
    initializer_range=0.15,  # large enough that logits are far from uniform
    rms_norm_eps=1e-6,
    attention_bias=False,
    bos_token_id=ENDOFTEXT_ID,
    eos_token_id=IM_END_ID,
    dtype="float32",
)

# Per family: the real model's shape, shrunk (see /work/shared/REFERENCE.md).
_FAMILY_CONFIGS = {
    "llama": dict(  # SmolLM2: tied embeddings, dense MLP
        num_hidden_layers=2,
        intermediate_size=128,
        tie_word_embeddings=True,
        mlp_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
    "qwen3_moe": dict(  # Qwen3-30B-A3B: routed experts on every layer, q/k norms
        num_hidden_layers=3,
        intermediate_size=128,  # only for layers listed in mlp_only_layers
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "qwen3_next": dict(  # Qwen3-Next-80B-A3B: hybrid DeltaNet / gated attention, shared expert
        intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        linear_conv_kernel_dim=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,  # each key head serves two value heads, as in the real model
        linear_key_head_dim=16,
        linear_value_head_dim=32,  # K != V so a transposed [K, V] state cannot pass
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    ),
}


def make_tiny(family: str, out_dir: str | Path, seed: int = 0, mtp_layers: int = 0, **overrides) -> Path:
    """Write a tiny random `family` checkpoint with its tokenizer into `out_dir`.

    `overrides` replace config fields (e.g. `layer_types=[...]`, `attention_bias=True`,
    `num_hidden_layers=2`); for qwen3_next, `layer_types` also sets the layer count, and
    `mtp_layers` adds that many random MTP layers (`mtp.*`, as Qwen3-Next-80B ships them, in
    `mtp.safetensors`: transformers has no MTP and loads the model without them).
    The global torch RNG is left as it was. Returns `out_dir` as a Path.
    Raises ValueError for an unknown family.
    """
    from transformers import GenerationConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    config = _config(family, overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _model_class(family)(config).to(torch.float32).eval()
        _perturb(model, family, torch.Generator().manual_seed(seed + 1))
    model.save_pretrained(out)
    _use_hub_spelling(out / "config.json")
    if mtp_layers:
        _write_mtp(model, family, mtp_layers, out, torch.Generator().manual_seed(seed + 2))
    GenerationConfig(
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=[IM_END_ID, ENDOFTEXT_ID],
        pad_token_id=ENDOFTEXT_ID,
    ).save_pretrained(out)
    _write_tokenizer(out, seed)
    return out


def _config(family: str, overrides: dict):
    from transformers import AutoConfig

    fields = {**_COMMON, **_FAMILY_CONFIGS[family], **overrides}
    if family == "qwen3_next":
        fields["layer_types"] = list(fields.get("layer_types") or DEFAULT_LAYER_TYPES)
        fields["num_hidden_layers"] = len(fields["layer_types"])
    return AutoConfig.for_model(family, **fields)


def _write_mtp(model: torch.nn.Module, family: str, layers: int, out: Path, gen: torch.Generator) -> None:
    """Random MTP weights beside the model's: `mtp.fc` [H, 2H], its three norms (zero-centred), and per MTP
    layer a full-attention decoder layer shaped as the model's (its first full-attention layer's
    tensors, randomized), with `num_nextn_predict_layers` in config.json."""
    from safetensors.torch import save_file

    if family != "qwen3_next":
        raise ValueError(f"{family} has no MTP layers; only qwen3_next does")
    cfg = model.config
    h = cfg.hidden_size
    first = cfg.layer_types.index("full_attention")
    state = model.state_dict()
    prefix = f"model.layers.{first}."
    tensors = {"mtp.fc.weight": 0.02 * torch.randn((h, 2 * h), generator=gen)}
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = 0.1 * torch.randn((h,), generator=gen)
    for j in range(layers):
        for name, t in state.items():
            if name.startswith(prefix):
                noise = torch.randn(t.shape, generator=gen) * (t.float().std() if t.numel() > 1 else 0.1)
                tensors[f"mtp.layers.{j}." + name[len(prefix):]] = (t.float() + noise).to(t.dtype).contiguous()
    save_file(tensors, out / "mtp.safetensors")
    path = out / "config.json"
    config = json.loads(path.read_text())
    config["num_nextn_predict_layers"] = layers
    path.write_text(json.dumps(dict(sorted(config.items())), indent=2) + "\n")


def _use_hub_spelling(path: Path) -> None:
    """Spell config keys as the released checkpoints do.

    transformers 5 saves Qwen3-MoE's expert count under its internal alias
    `num_local_experts`; Qwen3-30B-A3B's config.json says `num_experts`, and
    transformers reads either. (The weights are already in the Hub's per-expert layout.)
    """
    cfg = json.loads(path.read_text())
    if cfg.get("model_type") == "qwen3_moe" and "num_local_experts" in cfg:
        cfg["num_experts"] = cfg.pop("num_local_experts")
        path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")


def _model_class(family: str):
    from transformers import LlamaForCausalLM, Qwen3MoeForCausalLM, Qwen3NextForCausalLM

    return {"llama": LlamaForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM, "qwen3_next": Qwen3NextForCausalLM}[family]


@torch.no_grad()
def _perturb(model: torch.nn.Module, family: str, gen: torch.Generator) -> None:
    """Move every parameter that init leaves at a special value off it."""

    def randn_like(p: torch.Tensor) -> torch.Tensor:
        return torch.randn(p.shape, generator=gen, dtype=p.dtype)

    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind.endswith("RMSNormGated"):  # DeltaNet output norm: ordinary, weight around 1
            module.weight.copy_(1 + 0.1 * randn_like(module.weight))
        elif kind.endswith("RMSNorm"):
            # Qwen3-Next multiplies by (1 + weight), so its weights sit around 0.
            centre = 0.0 if family == "qwen3_next" else 1.0
            module.weight.copy_(centre + 0.1 * randn_like(module.weight))
        elif kind.endswith("GatedDeltaNet"):
            # g = -exp(A_log) * softplus(a + dt_bias). HF's A in [0.01, 16] gives decays down to
            # exp(-20), which erases the state every token; A in [0.05, 1] and dt_bias near -1
            # keep exp(g) mostly in (0.5, 1) so the recurrence carries information.
            a = 0.05 + 0.95 * torch.rand(module.A_log.shape, generator=gen)
            module.A_log.copy_(a.log())
            module.dt_bias.copy_(-1.0 + 0.5 * randn_like(module.dt_bias))
        for pname, p in module.named_parameters(recurse=False):
            if pname == "bias":
                p.copy_(0.1 * randn_like(p))


def _training_text(seed: int) -> list[str]:
    """A few hundred lines of English-like text, chat turns, numbers and code."""
    rng = random.Random(seed)
    words = (
        "the of and to in is that it for on with as was are be this by at from or an have not "
        "what which their there about would these other into more some could time only new "
        "model expert token layer cache memory state paris france capital city question answer "
        "hello world please thank you assistant user system reply quick brown fox jumps over lazy dog"
    ).split()
    lines = []
    for i in range(400):
        n = rng.randint(4, 14)
        sentence = " ".join(rng.choice(words) for _ in range(n))
        kind = i % 5
        if kind == 0:
            sentence = sentence.capitalize() + "."
        elif kind == 1:
            sentence = f"What is the {rng.choice(words)} of {rng.choice(words)}? {sentence}."
        elif kind == 2:
            sentence = f"{rng.randint(0, 9999)} + {rng.randint(0, 999)} = {rng.randint(0, 99999)}; {sentence}"
        elif kind == 3:
            sentence = f"def {rng.choice(words)}(x):\n    return x * {rng.randint(1, 9)}  # {sentence}"
        else:
            sentence = f"\"{sentence.title()}\", said the {rng.choice(words)}!\n"
        lines.append(sentence)
    return lines


def _write_tokenizer(out: Path, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(seed), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE - len(SPECIAL_TOKENS):
        raise RuntimeError(f"tokenizer training produced {tok.get_vocab_size()} tokens, wanted {VOCAB_SIZE - 3}")
    tok.add_special_tokens(list(SPECIAL_TOKENS))  # appended: ids VOCAB_SIZE-3 .. VOCAB_SIZE-1
    tok.save(str(out / "tokenizer.json"))

    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
