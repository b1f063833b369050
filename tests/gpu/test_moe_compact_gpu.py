"""The Triton MoE on compact experts at Qwen3-30B-A3B's shapes (H = 2048, I = 768, top-8), timed against
the bf16 slab (issue 20: the kernel dequantizes in registers; the bytes it reads per expert are the
compact extent's).

Extents are random valid blocks made on the card (random quants, fixed scales near H^-0.5 / the
quant range), so building 64 experts takes no CPU quantization. Each format's output must match
`reference.moe` over the same bytes (bf16 within 1e-2 of max|ref|), and the test records the
kernel's time per call next to bf16's, and the compact bytes read per second, at T = 1 and T = 32.
Not run in the session that wrote it (no GPU was lent): run by tools/gpu_check.
"""

from __future__ import annotations

import pytest
import torch

from radianced.kernels import reference
from radianced.kernels.formats import FORMATS, FP8_BLOCK
from tests.gpu.conftest import gpu_device, ms_per_call, record
from tests.kernels.compare import rel_err

E, TOP_K, INTER, HIDDEN = 64, 8, 768, 2048
SCALES = {"q8_0": (HIDDEN ** -0.5 / 73, 0.0), "q4_0": (HIDDEN ** -0.5 / 4.6, 0.0),
          "q4_1": (HIDDEN ** -0.5 / 4.6, -HIDDEN ** -0.5 * 1.7)}


@pytest.fixture(scope="module")
def moe():
    if gpu_device() != "cuda":
        pytest.skip("the Triton kernels need CUDA; on the CPU tests/kernels runs them in the interpreter")
    from radianced.kernels import moe
    return moe


def _piece(fmt: str, shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """Random valid bytes of a [N, K] matrix in `fmt` (uint8, on the card)."""
    n, k = shape
    if fmt == "fp8_b128":
        sn, sk = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
        out = torch.zeros(FORMATS[fmt].nbytes(shape), dtype=torch.uint8, device="cuda")
        scales = torch.full((sn * sk,), HIDDEN ** -0.5, device="cuda")
        values = torch.randn((n * k,), generator=g, device="cuda").to(torch.float8_e4m3fn)
        out[:4 * sn * sk] = scales.view(torch.uint8)
        out[4 * sn * sk:4 * sn * sk + n * k] = values.view(torch.uint8)
        return out
    f = FORMATS[fmt]
    blocks = torch.randint(0, 256, (n * k // f.block, f.block_bytes), generator=g, device="cuda", dtype=torch.uint8)
    d, m = SCALES[fmt]
    blocks[:, :2] = torch.tensor([d], dtype=torch.float16).view(torch.uint8).cuda()
    if fmt == "q4_1":
        blocks[:, 2:4] = torch.tensor([m], dtype=torch.float16).view(torch.uint8).cuda()
    return blocks.reshape(-1)


def _slab(fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))
    rows = [torch.cat([_piece(fmt, s, g) for s in shapes]) for _ in range(E)]
    width = (rows[0].numel() + 15) // 16 * 16
    slab = torch.zeros((E, width), dtype=torch.uint8, device="cuda")
    for i, r in enumerate(rows):
        slab[i, :r.numel()] = r
    return slab, torch.randperm(E, generator=g, device="cuda")


def _routing(t: int):
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn((t, HIDDEN), generator=g, device="cuda").bfloat16()
    logits = torch.randn((t, E), generator=g, device="cuda")
    w, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
    return x, ids, (w / w.sum(-1, keepdim=True)).bfloat16()


@pytest.mark.parametrize("t", [1, 32])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "fp8_b128"])
def test_compact_moe_matches_the_reference_and_is_timed_against_bf16(moe, fmt, t):
    slab, table = _slab(fmt)
    x, ids, w = _routing(t)
    got = moe.moe(x, ids, w, table, slab, INTER, weight_format=fmt)
    want = reference.moe(x.float(), ids, w.float(), table, slab, INTER, weight_format=fmt)
    err = rel_err(got, want)
    dense = torch.randn((E, 3 * INTER * HIDDEN), device="cuda").mul_(HIDDEN ** -0.5).bfloat16()
    ms = ms_per_call(lambda: moe.moe(x, ids, w, table, slab, INTER, weight_format=fmt))
    ms_bf16 = ms_per_call(lambda: moe.moe(x, ids, w, table, dense, INTER))
    routed = int(torch.unique(ids).numel())
    extent = moe.extent_layout(fmt, INTER, HIDDEN).size
    record({"test": "kernel_moe_compact", "format": fmt, "tokens": t, "rel_err": err, "tolerance": 1e-2,
            "ms": ms, "ms_bf16": ms_bf16, "speedup_vs_bf16": ms_bf16 / ms,
            "compact_gb_per_s": routed * extent / ms / 1e6,
            "bf16_gb_per_s": routed * dense.shape[1] * 2 / ms_bf16 / 1e6})
    assert err < 1e-2


NEXT_E, NEXT_K, NEXT_I = 512, 10, 512  # Qwen3-Next-80B-A3B's routed experts (H = 2048 as above)


@pytest.mark.parametrize("t", [1, 8])
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_staged_misses_equal_the_in_place_reads_and_are_timed_against_them(moe, fmt, t):
    """Every expert of a Qwen3-Next-shaped layer in the pinned host pool (rows a 4 KiB page apart, as
    tiers/host.py lays them out): the MoE with its misses staged on the card (kernels/stage.py, 64
    rows) gives the in-place reads' output bit for bit, and both are timed over 16 routings in turn
    (so no call finds the last one's experts in L2), with the distinct routed bytes a second each."""
    from radianced.kernels import stage

    g = torch.Generator(device="cuda").manual_seed(1)
    shapes = ((NEXT_I, HIDDEN), (NEXT_I, HIDDEN), (HIDDEN, NEXT_I))
    extent = sum(FORMATS[fmt].nbytes(s) for s in shapes)
    width, page = (extent + 15) // 16 * 16, (extent + 4095) // 4096 * 4096
    pool = torch.zeros((NEXT_E, page), dtype=torch.uint8, pin_memory=True)
    for e in range(NEXT_E):
        pool[e, :extent] = torch.cat([_piece(fmt, s, g) for s in shapes]).cpu()
    host = pool[:, :width]
    slab = torch.zeros((1, width), dtype=torch.uint8, device="cuda")  # no slot holds an expert
    table = -1 - torch.randperm(NEXT_E, generator=g, device="cuda")
    staging = torch.empty((64, width), dtype=torch.uint8, device="cuda")
    routings = []
    for i in range(16):
        x = torch.randn((t, HIDDEN), generator=g, device="cuda").bfloat16()
        w, ids = torch.randn((t, NEXT_E), generator=g, device="cuda").softmax(-1).topk(NEXT_K, dim=-1)
        routings.append((x, ids, (w / w.sum(-1, keepdim=True)).bfloat16()))
    turn = [0]

    def call(**kw):
        x, ids, w = routings[turn[0] % len(routings)]
        turn[0] += 1
        return moe.moe(x, ids, w, table, slab, NEXT_I, host, weight_format=fmt, deterministic=True, **kw)

    assert stage.wanted(t * NEXT_K, host, staging, fmt)
    for x, ids, w in routings[:2]:
        args = (x, ids, w, table, slab, NEXT_I, host)
        assert torch.equal(moe.moe(*args, weight_format=fmt, deterministic=True, staging=staging),
                           moe.moe(*args, weight_format=fmt, deterministic=True))
    distinct = sum(int(torch.unique(ids).numel()) for _, ids, _ in routings) / len(routings)
    ms_in_place = ms_per_call(call, iters=48)
    ms_staged = ms_per_call(lambda: call(staging=staging), iters=48)
    record({"test": "kernel_moe_staged_misses", "format": fmt, "tokens": t, "experts_routed": distinct,
            "extent_bytes": extent, "ms_in_place": ms_in_place, "ms_staged": ms_staged,
            "speedup": ms_in_place / ms_staged, "in_place_gb_per_s": distinct * extent / ms_in_place / 1e6,
            "staged_gb_per_s": distinct * extent / ms_staged / 1e6})
