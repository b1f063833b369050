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
The GGUF schemes follow `gguf.quants.quantize` (the gguf package's numpy port
of ggml-quants.c) step for step in torch, on the tensor's own device, so the
blocks are those llama.cpp would write for the same values (tests/model/
test_quantize.py holds them to gguf's bytes; a GPU quantizes a 30B model's
experts in seconds where numpy takes many minutes). Divisions that the
reference rounds once are taken as tensor divisions (`ieee_div`): torch's CUDA
kernel multiplies by a Python number's reciprocal. A matrix whose rows are not
a multiple of 32 values cannot take int8 / int4 and stays as it is.
"""

from __future__ import annotations

import re

import torch

from radianced.kernels.compact import CompactWeight
from radianced.kernels.dequant import pack_fp8_b128
from radianced.kernels.formats import FORMATS, FP8_BLOCK
from radianced.kernels.kv_quant import ieee_div

SCHEMES = {"int8": "q8_0", "int4": "q4_0", "fp8": "fp8_b128"}
CLASSES = ("experts", "layers", "embeddings")
FP8_MAX = 448.0  # the largest finite E4M3 value
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
    """The [N, K] matrix `w` (any float dtype, any device) in compact format `fmt`, rounded to nearest;
    its bytes on w's device."""
    n, k = w.shape
    w = w.float()
    if fmt == "fp8_b128":
        return _quantize_fp8(w, n, k)
    if not fits(fmt, (n, k)):
        raise ValueError(f"{fmt} needs rows of whole {FORMATS[fmt].block}-value blocks; got [{n}, {k}]")
    blocks = w.reshape(-1, FORMATS[fmt].block)
    data = _q8_0(blocks) if fmt == "q8_0" else _q4_0(blocks)
    return CompactWeight(fmt, (n, k), data.reshape(n, -1))


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """gguf's Q8_0.quantize_blocks: d = amax / 127, q = round-half-away(x / d), as fp16 d | int8 q."""
    d = ieee_div(blocks.abs().amax(dim=1, keepdim=True), 127.0)
    x = blocks * torch.where(d == 0, 0.0, torch.reciprocal(d))
    a = x.abs()
    whole = a.floor()
    q = torch.sign(x) * (whole + (2 * (a - whole)).floor())  # gguf's np_roundf, step for step
    return torch.cat((_fp16_bytes(d), q.to(torch.int8).view(torch.uint8)), dim=1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """gguf's Q4_0.quantize_blocks: d = (the value of largest magnitude) / -8, q = trunc(x / d + 8.5)
    clipped to 0..15, as fp16 d | 16 bytes (value j in the low nibble of byte j, j + 16 in its high one)."""
    top = blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True))
    d = top / -8  # a power of two: exact on every device
    q = (blocks * torch.where(d == 0, 0.0, torch.reciprocal(d)) + 8.5).trunc().clamp(0, 15).to(torch.uint8)
    half = blocks.shape[1] // 2
    return torch.cat((_fp16_bytes(d), q[:, :half] | (q[:, half:] << 4)), dim=1)


def _fp16_bytes(d: torch.Tensor) -> torch.Tensor:
    """[B, 1] fp32 scales -> [B, 2] bytes of their fp16 roundings."""
    return d.to(torch.float16).view(torch.uint8)


def _quantize_fp8(w: torch.Tensor, n: int, k: int) -> CompactWeight:
    sn, sk = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = torch.zeros(sn * FP8_BLOCK, sk * FP8_BLOCK, device=w.device)
    padded[:n, :k] = w
    blocks = padded.view(sn, FP8_BLOCK, sk, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))  # [sn, sk]
    scale = torch.where(amax > 0, ieee_div(amax, FP8_MAX), torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).view(sn * FP8_BLOCK, sk * FP8_BLOCK)[:n, :k].to(torch.float8_e4m3fn)
    return CompactWeight("fp8_b128", (n, k), pack_fp8_b128(q, scale))
