"""The Triton Gated DeltaNet kernels (gates, causal conv prefill and update, decode over state slots)
against `kernels/reference.py`.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (set up by
tests/kernels/interpreter.py before triton is imported), so shapes stay small and odd: 3
key heads and 6 value heads (non-powers of two), K = 24, V = 20 (padded inside
the kernels), C = 60 conv channels, W = 4. The decode tests use a state pool
with spare rows, slots out of order and a padding row (slot -1), and check that
rows nobody owns are untouched. fp32 within 1e-4 of max|ref|; bf16 within 1e-2
of the fp32 reference on the same bf16 values.

The chunked prefill wraps fla-core on CUDA and is tested on the GPU
(tests/gpu/test_kernels_gpu.py); here only its fp32 route (the reference) and
the error without fla-core.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.kernels.interpreter import DEVICE, rand, require_interpreted  # before triton loads
from tests.kernels.compare import f32, rel_err

from radianced.kernels import deltanet, reference

require_interpreted(deltanet._delta_decode_kernel, "deltanet")

HK, HV, K, V = 3, 6, 24, 20
C, W = 60, 4
POOL = 7  # state slots in the pool


def tol(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 1e-2


# -- gates -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gates_match_reference(dtype):
    """a spans softplus's regions (large negative, around 0, above torch's threshold of 20)."""
    a = rand(15, HV, dtype=dtype, seed=1, scale=8.0)
    a[0, :3] = torch.tensor([-30.0, 25.0, 0.0], dtype=dtype)
    b = rand(15, HV, dtype=dtype, seed=2, scale=3.0)
    a_log, dt_bias = rand(HV, seed=3), rand(HV, dtype=dtype, seed=4)
    g, beta = deltanet.deltanet_gates(a, b, a_log, dt_bias)
    want_g, want_beta = reference.deltanet_gates(a.cpu(), b.cpu(), a_log.cpu(), dt_bias.cpu())
    assert g.dtype == torch.float32 and beta.dtype == dtype
    assert rel_err(g.cpu(), want_g) < 1e-5
    assert rel_err(beta.cpu(), want_beta) < (1e-6 if dtype == torch.float32 else 4e-3)


# -- causal conv -----------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 2, 15, 63, 300])
@pytest.mark.parametrize("with_state", [False, True], ids=["fresh", "after_context"])
def test_conv_prefill_matches_reference(t, with_state):
    """T = 1 and 2 (< W - 1: the new state still holds old state columns) up to 300."""
    x, weight = rand(t, C, seed=t), rand(C, W, seed=5)
    state = rand(C, W - 1, seed=6) if with_state else None
    y, new_state = deltanet.causal_conv1d_prefill(x, weight, state)
    want_y, want_state = reference.causal_conv1d_prefill(x.cpu(), weight.cpu(), None if state is None else state.cpu())
    assert rel_err(y.cpu(), want_y) < 1e-4
    assert torch.equal(new_state.cpu(), want_state)


def test_conv_prefill_bf16():
    x, weight, state = rand(33, C, dtype=torch.bfloat16, seed=7), rand(C, W, dtype=torch.bfloat16, seed=8), \
        rand(C, W - 1, dtype=torch.bfloat16, seed=9)
    y, new_state = deltanet.causal_conv1d_prefill(x, weight, state)
    want_y, want_state = reference.causal_conv1d_prefill(f32(x), f32(weight), f32(state))
    assert y.dtype == new_state.dtype == torch.bfloat16
    assert rel_err(y.cpu(), want_y) < 1e-2 and torch.equal(new_state.cpu().float(), want_state)


SLOTS = [5, 0, -1, 3]  # out of order, one padding row; pool rows 1, 2, 4, 6 belong to nobody


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_update_over_state_slots(dtype):
    x, weight = rand(len(SLOTS), C, dtype=dtype, seed=10), rand(C, W, dtype=dtype, seed=11)
    pool = rand(POOL, C, W - 1, dtype=dtype, seed=12)
    slots = torch.tensor(SLOTS, device=DEVICE)
    want_pool = pool.cpu().float().clone()
    want = reference.causal_conv1d_update(f32(x), f32(weight), want_pool, slots.cpu())
    y = deltanet.causal_conv1d_update(x, weight, pool, slots)
    assert y.dtype == dtype and rel_err(y.cpu(), want) < tol(dtype)
    assert torch.equal(y[2].cpu(), torch.zeros(C, dtype=dtype))  # the padding row
    assert torch.equal(pool.cpu().float(), want_pool)  # shifted rows exact; unowned rows untouched


def test_conv_update_without_slots_is_row_per_sequence():
    x, weight, states = rand(2, C, seed=13), rand(C, W, seed=14), rand(2, C, W - 1, seed=15)
    want_states = states.cpu().clone()
    want = reference.causal_conv1d_update(x.cpu(), weight.cpu(), want_states)
    assert rel_err(deltanet.causal_conv1d_update(x, weight, states).cpu(), want) < 1e-4
    assert torch.equal(states.cpu(), want_states)


def test_conv_update_then_prefill_agree_token_by_token():
    """Decoding 5 tokens one at a time gives the prefill's outputs and final state."""
    x, weight, state = rand(5, C, seed=16), rand(C, W, seed=17), rand(C, W - 1, seed=18)
    y_all, state_all = deltanet.causal_conv1d_prefill(x, weight, state)
    pool = state[None].clone()
    ys = [deltanet.causal_conv1d_update(x[i:i + 1], weight, pool) for i in range(5)]
    assert rel_err(torch.cat(ys).cpu(), y_all.cpu()) < 1e-6
    assert torch.equal(pool[0].cpu(), state_all.cpu())


# -- recurrent decode ------------------------------------------------------------------------------


def decode_inputs(b: int, dtype: torch.dtype, seed: int):
    q, k = rand(b, HK, K, dtype=dtype, seed=seed), rand(b, HK, K, dtype=dtype, seed=seed + 1)
    v = rand(b, HV, V, dtype=dtype, seed=seed + 2)
    g = -torch.rand((b, HV), generator=torch.Generator().manual_seed(seed + 3)).to(DEVICE)  # log-decay <= 0
    beta = torch.rand((b, HV), generator=torch.Generator().manual_seed(seed + 4)).to(dtype).to(DEVICE)
    return q, k, v, g, beta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "raw"])
def test_decode_over_state_slots(dtype, l2norm):
    q, k, v, g, beta = decode_inputs(len(SLOTS), dtype, seed=20)
    pool = rand(POOL, HV, K, V, seed=25)  # fp32 states, as the product keeps them
    slots = torch.tensor(SLOTS, dtype=torch.int32, device=DEVICE)
    want_pool = pool.cpu().clone()
    want = reference.gated_delta_rule_decode(f32(q), f32(k), f32(v), g.cpu(), f32(beta), want_pool, slots.cpu(),
                                             use_qk_l2norm=l2norm, scale=0.3 if not l2norm else None)
    o = deltanet.gated_delta_rule_decode(q, k, v, g, beta, pool, slots, use_qk_l2norm=l2norm,
                                         scale=0.3 if not l2norm else None)
    assert o.dtype == dtype and rel_err(o.cpu(), want) < tol(dtype)
    assert torch.equal(o[2].cpu(), torch.zeros(HV, V, dtype=dtype))  # the padding row
    assert rel_err(pool.cpu(), want_pool) < 1e-5
    for row in (1, 2, 4, 6):
        assert torch.equal(pool[row].cpu(), want_pool[row])  # nobody's rows untouched


def test_decode_reads_strided_heads_as_the_model_passes_them():
    """q, k, v as views of the conv output [B, C'] (row stride C'), as qwen3_next splits it."""
    b = 3
    y = rand(b, 2 * HK * K + HV * V, seed=30)
    q, k, v = (t.view(b, -1, d) for t, d in zip(y.split([HK * K, HK * K, HV * V], dim=-1), (K, K, V)))
    _, _, _, g, beta = decode_inputs(b, torch.float32, seed=31)
    states = rand(b, HV, K, V, seed=32)
    want_states = states.cpu().clone()
    want = reference.gated_delta_rule_decode(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), want_states,
                                             use_qk_l2norm=True)
    assert rel_err(deltanet.gated_delta_rule_decode(q, k, v, g, beta, states, use_qk_l2norm=True).cpu(), want) < 1e-4
    assert rel_err(states.cpu(), want_states) < 1e-5


def test_decode_steps_follow_the_recurrence_over_a_sequence():
    """15 decode steps from a fresh state equal the token-by-token definition (and the chunked form)."""
    t = 15
    q, k, v, g, beta = decode_inputs(t, torch.float32, seed=40)
    pool = torch.zeros((3, HV, K, V), device=DEVICE)
    slot = torch.tensor([1], device=DEVICE)
    outs = [deltanet.gated_delta_rule_decode(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], pool,
                                             slot, use_qk_l2norm=True) for i in range(t)]
    want_o, want_s = reference.gated_delta_rule_recurrent(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(),
                                                          use_qk_l2norm=True)
    assert rel_err(torch.cat(outs).cpu(), want_o) < 1e-4
    assert rel_err(pool[1].cpu(), want_s) < 1e-4
    chunk_o, _ = reference.gated_delta_rule_chunked(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), use_qk_l2norm=True)
    assert rel_err(torch.cat(outs).cpu(), chunk_o) < 1e-4


# -- a verify step: every verify-shaped sequence's positions in one launch ---------------------------

DRAFTS = 4  # draft slots per sequence; the pool: 2 sequences' slots, then 2 x DRAFTS draft slots


def _step(t: int) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
    """A step of 3 sequences: a prompt chunk of 3 rows the verify ops leave alone (slot -1), then one in
    state slot 1 with T rows (its last token and T - 1 drafts), then a one-token decode in slot 0.
    (query_start, slots, [(first row, end row, slot)] of the two the ops run)."""
    starts = [0, 3, 3 + t, 4 + t]
    return (torch.tensor(starts, dtype=torch.int32, device=DEVICE), torch.tensor([-1, 1, 0], device=DEVICE),
            [(3, 3 + t, 1), (3 + t, 4 + t, 0)])


@pytest.mark.parametrize("t", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verify_launch_is_the_decode_ops_position_by_position_bit_for_bit(t, dtype):
    """Two sequences' positions through `causal_conv1d_verify` and `gated_delta_rule_verify`, one launch
    each, against the decode kernels one position at a time with the state copied to the draft slot
    after each (the model's loop before): every output row of theirs and every pool row equal, bit
    for bit; the prompt chunk's rows and the pool's other rows untouched."""
    starts, slots, runs = _step(t)
    n = 4 + t
    x, weight = rand(n, C, dtype=dtype, seed=60), rand(C, W, dtype=dtype, seed=61)
    conv = rand(2 * (1 + DRAFTS), C, W - 1, dtype=dtype, seed=62)
    q, k, v, g, beta = decode_inputs(n, dtype, seed=63)
    rec = rand(2 * (1 + DRAFTS), HV, K, V, seed=68)
    conv_loop, rec_loop = conv.clone(), rec.clone()
    y_loop, o_loop = {}, {}
    for lo, hi, row in runs:
        slot = torch.tensor([row], device=DEVICE)
        for j in range(lo, hi):
            y_loop[j] = deltanet.causal_conv1d_update(x[j:j + 1], weight, conv_loop, slot)
            o_loop[j] = deltanet.gated_delta_rule_decode(q[j:j + 1], k[j:j + 1], v[j:j + 1], g[j:j + 1],
                                                         beta[j:j + 1], rec_loop, slot, use_qk_l2norm=True)
            if j < hi - 1:
                conv_loop[2 + row * DRAFTS + j - lo] = conv_loop[row]
                rec_loop[2 + row * DRAFTS + j - lo] = rec_loop[row]
    y = deltanet.causal_conv1d_verify(x, weight, conv, starts, slots, 2, DRAFTS)
    o = deltanet.gated_delta_rule_verify(q, k, v, g, beta, rec, starts, slots, 2, DRAFTS, use_qk_l2norm=True)
    ran = sorted(y_loop)
    assert ran == list(range(3, n))
    assert torch.equal(y[3:].cpu(), torch.cat([y_loop[j] for j in ran]).cpu())
    assert torch.equal(o[3:].cpu(), torch.cat([o_loop[j] for j in ran]).cpu())
    assert torch.equal(conv.cpu(), conv_loop.cpu()) and torch.equal(rec.cpu(), rec_loop.cpu())


def test_the_reference_verify_ops_agree_with_the_kernels():
    """The CPU's verify ops (reference.py: the decode ops looped, the states copied) against the kernels: fp32."""
    starts, slots, _ = _step(4)
    n = 8
    x, weight = rand(n, C, seed=80), rand(C, W, seed=81)
    conv = rand(2 * (1 + DRAFTS), C, W - 1, seed=82)
    q, k, v, g, beta = decode_inputs(n, torch.float32, seed=83)
    rec = rand(2 * (1 + DRAFTS), HV, K, V, seed=88)
    want_conv, want_rec = conv.cpu().clone(), rec.cpu().clone()
    want_y = reference.causal_conv1d_verify(x.cpu(), weight.cpu(), want_conv, starts.cpu(), slots.cpu(), 2, DRAFTS)
    want_o = reference.gated_delta_rule_verify(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), want_rec, starts.cpu(),
                                               slots.cpu(), 2, DRAFTS, use_qk_l2norm=True)
    y = deltanet.causal_conv1d_verify(x, weight, conv, starts, slots, 2, DRAFTS)
    o = deltanet.gated_delta_rule_verify(q, k, v, g, beta, rec, starts, slots, 2, DRAFTS, use_qk_l2norm=True)
    assert rel_err(y[3:].cpu(), want_y[3:]) < 1e-5 and rel_err(o[3:].cpu(), want_o[3:]) < 1e-4
    assert rel_err(conv.cpu(), want_conv) < 1e-6 and rel_err(rec.cpu(), want_rec) < 1e-4
    untouched = [2, 3, 4, 5, 9]  # slot 0's draft rows (its one token drafts nothing), slot 1's fourth
    assert torch.equal(rec[untouched].cpu(), want_rec[untouched]) and torch.equal(conv[untouched].cpu(),
                                                                                  want_conv[untouched])


def test_verify_refuses_slots_that_do_not_match_the_sequences():
    q, k, v, g, beta = decode_inputs(2, torch.float32, seed=70)
    rec = rand(4, HV, K, V, seed=71)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"query_start must be an int32 \[B\+1\] tensor and slots an integer \[B\]"):
        deltanet.gated_delta_rule_verify(q, k, v, g, beta, rec, starts, torch.tensor([0], device=DEVICE), 2, 1)
    with pytest.raises(ValueError, match=r"query_start must be an int32"):
        deltanet.gated_delta_rule_verify(q, k, v, g, beta, rec, starts.long(), torch.tensor([0, 1], device=DEVICE),
                                         2, 1)


def test_decode_refuses_mismatched_heads_and_slots():
    q, k, v, g, beta = decode_inputs(2, torch.float32, seed=50)
    pool = torch.zeros((POOL, HV, K, V), device=DEVICE)
    with pytest.raises(ValueError, match=r"value heads \(6\) be a multiple of key heads \(4\)"):
        deltanet.gated_delta_rule_decode(rand(2, 4, K), rand(2, 4, K), v, g, beta, pool, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"slots must be an integer \[2\] tensor"):
        deltanet.gated_delta_rule_decode(q, k, v, g, beta, pool, torch.tensor([0.0, 1.0], device=DEVICE))
    with pytest.raises(ValueError, match=r"without slots state needs one row per sequence \(2\), has 7"):
        deltanet.gated_delta_rule_decode(q, k, v, g, beta, pool)


# -- chunked prefill (fla-core on CUDA) ------------------------------------------------------------


def test_chunked_fp32_runs_the_reference_form():
    """fp32 is the exact path: fla's TF32 triangular solve is not used for it."""
    t = 70
    q, k, v, g, beta = decode_inputs(t, torch.float32, seed=60)
    state = rand(HV, K, V, seed=61)
    o, s = deltanet.gated_delta_rule_chunked(q, k, v, g, beta, state, use_qk_l2norm=True)
    want_o, want_s = reference.gated_delta_rule_recurrent(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), state.cpu(),
                                                          use_qk_l2norm=True)
    assert rel_err(o.cpu(), want_o) < 1e-4 and rel_err(s.cpu(), want_s) < 1e-4


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="fla-core is installed here")
def test_chunked_bf16_without_fla_names_the_fix():
    q, k, v, g, beta = decode_inputs(3, torch.bfloat16, seed=70)
    with pytest.raises(ImportError, match=r"needs fla-core .*radianced\[gpu\]"):
        deltanet.gated_delta_rule_chunked(q, k, v, g, beta)
