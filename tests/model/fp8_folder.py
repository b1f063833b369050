"""A tiny Hugging Face block-scaled FP8 Qwen3-MoE folder, laid out as Qwen's "-FP8" releases are.

Every linear of the decoder (attention projections, each routed expert's gate/up/down, named per
expert) is stored as F8_E4M3 with an fp32 `weight_scale_inv` per 128 x 128 block; the embeddings,
lm_head, norms and router stay bf16; config.json carries the `quantization_config`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from radianced.kernels.dequant import split_fp8_b128
from radianced.model.quantize import quantize
from radianced.model.tiny import make_tiny

QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values, scales = split_fp8_b128(quantize(w, "fp8_b128").data, tuple(w.shape))
    return values.clone(), scales.clone()


def make_fp8_folder(out: Path) -> Path:
    """The tiny qwen3_moe (`make_tiny`) re-saved as an FP8 checkpoint in `out`; returns `out`."""
    make_tiny("qwen3_moe", out)
    files = sorted(out.glob("*.safetensors"))
    tensors = {k: v for f in files for k, v in load_file(f).items()}
    for f in files:
        f.unlink()
    out_tensors: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            prefix = name.rsplit(".", 1)[0]
            for e in range(t.shape[0]):
                if name.endswith("gate_up_proj"):
                    parts = dict(zip(("gate_proj", "up_proj"), t[e].chunk(2)))
                else:
                    parts = {"down_proj": t[e]}
                for proj, w in parts.items():
                    out_tensors[f"{prefix}.{e}.{proj}.weight"], out_tensors[f"{prefix}.{e}.{proj}.weight_scale_inv"] = _fp8(w)
        elif t.dim() == 2 and ("self_attn." in name or ".experts." in name):
            out_tensors[name], out_tensors[f"{name}_scale_inv"] = _fp8(t)
        else:
            out_tensors[name] = t.to(torch.bfloat16)
    save_file({k: v.contiguous() for k, v in out_tensors.items()}, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
