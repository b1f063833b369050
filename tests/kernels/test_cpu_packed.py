"""The host backend's int4-packed compact weights (kernels/cpu_packed.py) against two oracles, on odd shapes.

The kernel's own contract: x rounded to bf16, each group's scale and zero rounded to bf16,
fp32 products and sums, one bf16 rounding of the result; the oracle here computes that in
float64 from the GGUF bytes, unpacked with numpy (not with the code under test). And against
the reference (fp32 dequantization, fp32 F.linear): the same bf16 roundings bound the gap.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from radianced.kernels import cpu, reference
from radianced.kernels.compact import CompactWeight, cat_rows, pack_together
from radianced.kernels.cpu_packed import pack

SHAPES = [(1, 32), (17, 96), (50, 64), (33, 160)]  # N not a multiple of 16, K one to five blocks
ROWS = (1, 3, 20)
U = 2.0 ** -8  # bf16's unit roundoff: 7 stored mantissa bits, so rounding to nearest is within 2^-8 relative


def compact(fmt: str, n: int, k: int, seed: int) -> CompactWeight:
    """A GGUF-quantized random [n, k] matrix (gguf's own quantizer writes the blocks)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy()
    data = gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, fmt.upper()))
    return CompactWeight(fmt, (n, k), torch.from_numpy(data))


def kernel_parts(w: CompactWeight) -> tuple[np.ndarray, np.ndarray]:
    """(dense values the kernel multiplies in float64, the magnitude bound |scale (q - 8)| + |zero| per value),
    from the bytes with numpy: each block's scale and zero rounded to bf16 as the packing does."""
    n, k = w.shape
    raw = w.data.numpy().reshape(n, k // 32, -1)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if w.fmt == "q8_0":
        q = raw[..., 2:].copy().view(np.int8).astype(np.float64)  # d q exactly: d's only rounding is bf16's
        s = bf16(d)[..., None]
        return (s * q).reshape(n, k), (abs(s * q)).reshape(n, k)
    nib = raw[..., -16:]
    q = np.concatenate([nib & 15, nib >> 4], axis=-1).astype(np.float64)  # [n, k/32, 32]
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if w.fmt == "q4_1" else 0 * d
    s, z = bf16(d)[..., None], bf16(m + 8 * d if w.fmt == "q4_1" else 0 * d)[..., None]
    return ((q - 8) * s + z).reshape(n, k), (abs((q - 8) * s) + abs(z)).reshape(n, k)


def bf16(a) -> np.ndarray:
    return torch.from_numpy(np.asarray(a, dtype=np.float32)).bfloat16().double().numpy()


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_the_packed_matmul_is_its_documented_bf16_math_and_near_the_reference(fmt, n, k):
    w = compact(fmt, n, k, seed=n * k).packed_for_cpu()
    assert w.packed is not None and w.packed.n == n
    values, magnitude = kernel_parts(w)
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        y = cpu.linear(x, w).double().numpy()
        assert y.shape == (m, n)
        xb = x.bfloat16().double().numpy()
        oracle, bound = xb @ values.T, abs(xb) @ magnitude.T
        # one bf16 rounding of the result, plus fp32 accumulation over k terms (measured: y is the float64
        # oracle rounded to the nearest bf16 in every element of these shapes)
        np.testing.assert_array_less(abs(y - oracle), U * abs(oracle) + k * 2.0 ** -23 * bound + 1e-30)
        # against the reference: x's and the scales' bf16 roundings on top, each within U of the magnitudes
        ref = reference.linear(x, w).double().numpy()
        np.testing.assert_array_less(abs(y - ref), 3 * U * (abs(x.double().numpy()) @ magnitude.T) + 1e-30)


def test_bias_residual_norm_and_rows_of_none_on_the_packed_path():
    g = torch.Generator().manual_seed(5)
    w = compact("q4_1", 40, 64, seed=5).packed_for_cpu()
    x, bias, res, nw = (torch.randn(*s, generator=g) for s in ((3, 64), (40,), (3, 40), (64,)))
    plain = cpu.linear(cpu.rms_norm(x, nw, 1e-6), w)
    y, normed = cpu.linear(x, w, bias, residual=res.clone(), norm=(nw, 1e-6, False), keep_normed=True)
    assert torch.equal(normed, cpu.rms_norm(x, nw, 1e-6))
    assert torch.equal(y, plain + bias + res)
    assert cpu.linear(x[:0], w).shape == (0, 40)


def test_silu_mlp_runs_each_matmul_on_the_packing():
    g = torch.Generator().manual_seed(6)
    gate, up, down = (compact(f, *s, seed=i).packed_for_cpu()
                      for i, (f, s) in enumerate((("q4_0", (96, 64)), ("q4_1", (96, 64)), ("q8_0", (64, 96)))))
    x = torch.randn(4, 64, generator=g)
    expected = cpu.linear(F.silu(cpu.linear(x, gate)) * cpu.linear(x, up), down)
    assert torch.equal(cpu.silu_mlp(x, gate, up, down), expected)
    ref = reference.silu_mlp(x, gate, up, down)
    assert torch.allclose(cpu.silu_mlp(x, gate, up, down), ref, rtol=0.02, atol=0.02 * float(ref.abs().max()))


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_matrices_packed_together_keep_each_product_and_the_mlp_reads_them_in_one_call(fmt, monkeypatch):
    """`pack_together` (the MLP's gate and up): one packing, each part its own rows of it (a part's N not
    a multiple of 16), each part's product the one it had alone, bit for bit; silu_mlp makes one
    kernel call for both."""
    gate, up = compact(fmt, 50, 96, seed=1).packed_for_cpu(), compact(fmt, 33, 96, seed=2).packed_for_cpu()
    g2, u2 = pack_together([gate, up])
    assert g2.packed.weight is u2.packed.weight and (g2.packed.first, u2.packed.first) == (0, 50)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(4))
    assert torch.equal(cpu.linear(x, g2), cpu.linear(x, gate)) and torch.equal(cpu.linear(x, u2), cpu.linear(x, up))
    up = compact(fmt, 50, 96, seed=2).packed_for_cpu()  # the MLP's up has the gate's N
    g2, u2 = pack_together([gate, up])
    down = torch.randn(64, 50, generator=torch.Generator().manual_seed(5))
    calls = []
    shared = cpu.cpu_packed.matmul_shared
    monkeypatch.setattr(cpu.cpu_packed, "matmul_shared", lambda x, ws: calls.append(len(ws)) or shared(x, ws))
    assert torch.equal(cpu.silu_mlp(x, g2, u2, down), cpu.silu_mlp(x, gate, up, down))
    assert calls == [2, 1, 1]  # together: one call; apart: one each
    assert pack_together([gate, torch.randn(4, 96)])[0] is gate  # not all packed: as they are


def test_packing_is_made_once_kept_by_cat_rows_and_left_to_formats_that_have_one():
    a, b = compact("q4_1", 20, 64, seed=1).packed_for_cpu(), compact("q4_1", 12, 64, seed=2).packed_for_cpu()
    joined = cat_rows([a, b])
    assert joined.packed is not None and joined.packed.n == 32
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(cpu.linear(x, joined), torch.cat([cpu.linear(x, a), cpu.linear(x, b)], dim=-1))
    assert a.packed_for_cpu() is a  # already packed: not packed again
    mixed = cat_rows([a, compact("q8_0", 16, 64, seed=7).packed_for_cpu()])  # a RowStack: each part's kernel
    assert torch.equal(cpu.linear(x, mixed), torch.cat([cpu.linear(x, p) for p in mixed.parts], dim=-1))
    unpacked = cat_rows([compact("q4_1", 20, 64, seed=1), b])
    assert unpacked.packed is None and unpacked.to("cpu").packed is None
    k = CompactWeight("q4_k", (16, 256), torch.zeros(16 * 144, dtype=torch.uint8))
    assert k.packed_for_cpu() is k  # a K-quant keeps its per-use dequantization
    with pytest.raises(ValueError, match="q4_k has no int4 packing"):
        pack("q4_k", k.shape, k.data)
