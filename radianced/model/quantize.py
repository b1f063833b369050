"""`--quantize`: requantize a floating-point source into compact formats, per class of weight.

    --quantize experts=int4,layers=fp8,embeddings=int8

Classes: `experts` (the routed experts' gate/up/down), `layers` (every other 2-D
matrix of a decoder layer: attention and DeltaNet projections, dense MLP, shared
expert; the router and the shared expert's one-row gate stay as they are: tiny,
and they pick the experts) and `embeddings` (the token embeddings and lm_head).
Norms, biases, convolutions and the MTP head's own tensors are never quantized.

Schemes, all round to nearest, nothing calibrated:
    int8 -> q8_0      a scale per 32 (fp16), as ggml's quantize_row_q8_0
    int4 -> q4_0      a scale per 32 (fp16), symmetric 4-bit, as ggml's quantize_row_q4_0
    fp8  -> fp8_b128  E4M3 with an fp32 scale per 128 x 128 block, scale = amax / 448 (the
                      layout and rule of Hugging Face's FP8 checkpoints)
The GGUF schemes use `gguf.quants.quantize` itself, so the blocks are those
llama.cpp would write for the same values. A matrix whose rows are not a
multiple of 32 values cannot take int8 / int4 and stays as it is.
"""

from __future__ import annotations

import re

import gguf
import torch

from radianced.kernels.compact import CompactWeight
from radianced.kernels.dequant import pack_fp8_b128
from radianced.kernels.formats import FORMATS, FP8_BLOCK

SCHEMES = {"int8": "q8_0", "int4": "q4_0", "fp8": "fp8_b128"}
CLASSES = ("experts", "layers", "embeddings")
FP8_MAX = 448.0  # the largest finite E4M3 value
_GGUF_TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
_KEPT = re.compile(r"(norm|\.bias$|mlp\.gate\.weight$|shared_expert_gate|conv1d|A_log|dt_bias)")


def parse_quantize(spec: str) -> dict[str, str]:
    """"experts=int4,layers=fp8" -> {"experts": "q4_0", "layers": "fp8_b128"}; ValueError naming the bad part."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        cls, _, scheme = part.partition("=")
        if cls not in CLASSES or scheme not in SCHEMES:
            raise ValueError(f"--quantize {part!r}: expected CLASS=SCHEME with CLASS one of {', '.join(CLASSES)} "
                             f"and SCHEME one of {', '.join(SCHEMES)}, e.g. experts=int4,layers=fp8")
        if cls in out:
            raise ValueError(f"--quantize names {cls} twice")
        out[cls] = SCHEMES[scheme]
    if not out:
        raise ValueError("--quantize is empty; e.g. --quantize experts=int4,layers=fp8")
    return out


def plain_format(name: str, shape: tuple[int, ...], formats: dict[str, str]) -> str | None:
    """The compact format a plain (non-expert) tensor `name` gets, or None to keep it as it is."""
    if len(shape) != 2 or name.startswith("mtp.") or _KEPT.search(name):
        return None
    cls = "embeddings" if ("embed_tokens" in name or name.startswith("lm_head")) else "layers"
    fmt = formats.get(cls)
    return fmt if fmt is not None and fits(fmt, shape) else None


def fits(fmt: str, shape: tuple[int, int]) -> bool:
    """Whether a [N, K] matrix can be stored in `fmt` (GGUF formats need whole blocks per row)."""
    return shape[1] % FORMATS[fmt].block == 0


def quantize(w: torch.Tensor, fmt: str) -> CompactWeight:
    """The [N, K] matrix `w` (any float dtype) in compact format `fmt`, rounded to nearest."""
    n, k = w.shape
    if fmt == "fp8_b128":
        return _quantize_fp8(w.float(), n, k)
    data = gguf.quants.quantize(w.float().contiguous().numpy(), _GGUF_TYPES[fmt])
    return CompactWeight(fmt, (n, k), torch.from_numpy(data))


def _quantize_fp8(w: torch.Tensor, n: int, k: int) -> CompactWeight:
    sn, sk = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = torch.zeros(sn * FP8_BLOCK, sk * FP8_BLOCK)
    padded[:n, :k] = w
    blocks = padded.view(sn, FP8_BLOCK, sk, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))  # [sn, sk]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).view(sn * FP8_BLOCK, sk * FP8_BLOCK)[:n, :k].to(torch.float8_e4m3fn)
    return CompactWeight("fp8_b128", (n, k), pack_fp8_b128(q, scale))
