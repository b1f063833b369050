"""The Triton linear on compact weights at Qwen3-30B-A3B's shapes, timed against the bf16 weight
(issue 20: the linear/gemv kernels dequantize in registers; the bytes read are the compact ones).

q/k/v 2048 -> 5120 and o_proj 4096 -> 2048 (with the residual), at T = 1 (gemv, the q/k/v with the
layer's norm in its launch), 8 ("dot" tiles; bf16 q/k/v there is cuBLAS), 32 (a decode batch: 32-row
tiles) and 4,096 (prefill: 128-row tiles against bf16 cuBLAS; the number that says whether a
workspace or fp8 tensor-core path should take over above some T, kernels/linear.py's docstring).
Weights are `quantize` / gguf blocks of a random matrix, made on the host once per format. Each
output (poisoned with NaN first) must match `reference.linear` on the same `CompactWeight` in fp32
within 1e-2 of max|ref| (bf16 activations: the kernel rounds the weight, the product and the
residual sum to bf16). The test records the time per call next to bf16's and the compact bytes
read per second. Not run in the session that wrote it (no GPU was lent): run by tools/gpu_check.
"""

from __future__ import annotations

import gguf
import pytest
import torch

from radianced.kernels import reference
from radianced.kernels.compact import CompactWeight
from tests.gpu.conftest import gpu_device, ms_per_call, record
from tests.kernels.compare import rel_err

SHAPES = {"qkv": (5120, 2048), "o_proj": (2048, 4096)}


@pytest.fixture(scope="module")
def linear():
    if gpu_device() != "cuda":
        pytest.skip("the Triton kernels need CUDA; on the CPU tests/kernels runs them in the interpreter")
    from radianced.kernels import linear
    return linear


@pytest.fixture(scope="module")
def weights():
    """(bf16 weight on the card, {format: its CompactWeight on the card}) per shape name."""
    from radianced.model.quantize import quantize

    out = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn((n, k), generator=torch.Generator().manual_seed(n + k)) * k ** -0.5
        q41 = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1)
        compact = {f: quantize(w, f) for f in ("q8_0", "q4_0", "fp8_b128")}
        compact["q4_1"] = CompactWeight("q4_1", (n, k), torch.from_numpy(q41))
        out[name] = (w.bfloat16().cuda(), {f: c.to("cuda") for f, c in compact.items()})
    return out


@pytest.mark.parametrize("t", [1, 8, 32, 4096])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "fp8_b128"])
def test_compact_linear_matches_the_reference_and_is_timed_against_bf16(linear, weights, fmt, shape, t, monkeypatch):
    dense, compact = weights[shape]
    w = compact[fmt]
    n, k = w.shape
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn((t, k), generator=g, device="cuda").bfloat16()
    residual = torch.randn((t, n), generator=g, device="cuda").bfloat16() if shape == "o_proj" else None
    norm = (torch.rand((k,), generator=g, device="cuda").bfloat16() + 0.5, 1e-6, False) if shape == "qkv" else None
    with monkeypatch.context() as m:  # the op's outputs start as NaN: an element it does not write shows
        empty = torch.empty
        m.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
        out = linear.linear(x, w, residual=residual, norm=norm)
    want = reference.linear(x.float(), w.dequantize(torch.bfloat16).float(),
                            residual=None if residual is None else residual.float(),
                            norm=None if norm is None else (norm[0].float(), *norm[1:]))
    err = rel_err(out, want)
    ms = ms_per_call(lambda: linear.linear(x, w, residual=residual, norm=norm))
    ms_bf16 = ms_per_call(lambda: linear.linear(x, dense, residual=residual, norm=norm))
    cfg = linear.linear_config(t, n, k, torch.bfloat16, fmt)
    record({"test": "kernel_linear_compact", "format": fmt, "shape": shape, "n": n, "k": k, "tokens": t,
            "kind": cfg.kind, "block_m": cfg.block_m, "rel_err": err, "tolerance": 1e-2, "ms": ms,
            "ms_bf16": ms_bf16, "speedup_vs_bf16": ms_bf16 / ms, "compact_gb_per_s": w.nbytes / ms / 1e6,
            "bf16_gb_per_s": dense.numel() * 2 / ms_bf16 / 1e6,
            "tflops": 2 * t * n * k / ms / 1e9, "tflops_bf16": 2 * t * n * k / ms_bf16 / 1e9})
    assert not out.isnan().any() and err < 1e-2
