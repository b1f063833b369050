"""The Gated DeltaNet reference: the chunked prefill form, the token recurrence,
the batched decode step and transformers' torch paths are one function."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from radianced.kernels.reference import (
    causal_conv1d_prefill, causal_conv1d_update, deltanet_gates, gated_delta_rule_chunked,
    gated_delta_rule_decode, gated_delta_rule_recurrent, l2norm,
)

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
# The plain torch functions, even where fla is installed and transformers would dispatch to it.
hf_chunk = inspect.unwrap(qwen3_next.torch_chunk_gated_delta_rule)
hf_recurrent = inspect.unwrap(qwen3_next.torch_recurrent_gated_delta_rule)

HK, HV, DK, DV = 2, 4, 16, 32  # two value heads per key head, K != V, as the tiny qwen3_next


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def delta_inputs(t: int, hk: int = HK, hv: int = HV, dk: int = DK, dv: int = DV, seed: int = 0, batch=()):
    """Raw q, k, v, log-decay g and beta for T tokens, shaped [*batch, T, H, D] / [*batch, T, H]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, t, hk, dk, generator=gen)
    k = torch.randn(*batch, t, hk, dk, generator=gen)
    v = torch.randn(*batch, t, hv, dv, generator=gen)
    # exp(g) spread over about (0.2, 1): some heads forget fast, some barely at all
    g = -F.softplus(torch.randn(*batch, t, hv, generator=gen) * 2 - 1.5)
    beta = torch.rand(*batch, t, hv, generator=gen)
    return q, k, v, g, beta


def random_state(hv: int = HV, dk: int = DK, dv: int = DV, seed: int = 1, batch=()):
    return torch.randn(*batch, hv, dk, dv, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("t", [1, 15, 63, 64, 65, 300])
def test_chunked_equals_token_recurrence_from_a_nonzero_state(t):
    q, k, v, g, beta = delta_inputs(t, seed=t)
    s0 = random_state(seed=t + 1)
    o_ref, s_ref = gated_delta_rule_recurrent(q, k, v, g, beta, s0, use_qk_l2norm=True)
    o, s = gated_delta_rule_chunked(q, k, v, g, beta, s0, use_qk_l2norm=True)
    assert o.shape == (t, HV, DV) and s.shape == (HV, DK, DV)
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(s, s_ref) < 1e-5


@pytest.mark.parametrize("t", [65, 300])
def test_chunked_equals_recurrence_when_the_state_barely_decays(t):
    """exp(g) near 1: the initial state and early tokens still dominate the last outputs."""
    q, k, v, _, beta = delta_inputs(t, seed=t + 2)
    g = -0.01 * torch.rand(t, HV, generator=torch.Generator().manual_seed(t))
    s0 = random_state(seed=t + 3)
    o_ref, s_ref = gated_delta_rule_recurrent(q, k, v, g, beta, s0, use_qk_l2norm=True)
    o, s = gated_delta_rule_chunked(q, k, v, g, beta, s0, use_qk_l2norm=True)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 128])
def test_chunked_equals_recurrence_for_any_chunk_size(chunk_size):
    q, k, v, g, beta = delta_inputs(100, seed=3)
    s0 = random_state(seed=4)
    o_ref, s_ref = gated_delta_rule_recurrent(q, k, v, g, beta, s0, use_qk_l2norm=True)
    o, s = gated_delta_rule_chunked(q, k, v, g, beta, s0, use_qk_l2norm=True, chunk_size=chunk_size)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_recurrence_matches_the_rule_written_per_head():
    """The definition, one value head and one token at a time, with the scale after l2norm."""
    q, k, v, g, beta = delta_inputs(9, seed=5)
    s0 = random_state(seed=6)
    o, s = gated_delta_rule_recurrent(q, k, v, g, beta, s0, use_qk_l2norm=True)
    for h in range(HV):
        kh = h // (HV // HK)
        S = s0[h].clone()
        for t in range(9):
            qt = q[t, kh] / q[t, kh].pow(2).sum().add(1e-6).sqrt() / DK**0.5
            kt = k[t, kh] / k[t, kh].pow(2).sum().add(1e-6).sqrt()
            S = S * g[t, h].exp()
            delta = beta[t, h] * (v[t, h] - S.T @ kt)
            S = S + torch.outer(kt, delta)
            torch.testing.assert_close(o[t, h], S.T @ qt, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(s[h], S, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t,hk,hv,dk,dv,chunk_size", [
    (1, 2, 4, 16, 32, 64), (37, 3, 3, 8, 8, 16), (130, 2, 4, 16, 32, 64), (64, 1, 2, 32, 16, 32),
])
@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_matches_transformers_torch_paths(t, hk, hv, dk, dv, chunk_size, use_qk_l2norm):
    q, k, v, g, beta = delta_inputs(t, hk, hv, dk, dv, seed=t, batch=(2,))
    if not use_qk_l2norm:  # keep beta * |k|^2 < 2 so the unnormalized rule stays bounded
        k = l2norm(k) * 0.9
    s0 = random_state(hv, dk, dv, seed=7, batch=(2,))
    hf_kwargs = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm)
    o_hf_chunk, s_hf_chunk = hf_chunk(q, k, v, g, beta, chunk_size=chunk_size, **hf_kwargs)
    o_hf_rec, s_hf_rec = hf_recurrent(q, k, v, g, beta, **hf_kwargs)
    for b in range(2):
        args = (q[b], k[b], v[b], g[b], beta[b], s0[b])
        o, s = gated_delta_rule_chunked(*args, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
        assert rel_err(o, o_hf_chunk[b]) < 1e-5 and rel_err(s, s_hf_chunk[b]) < 1e-5
        o, s = gated_delta_rule_recurrent(*args, use_qk_l2norm=use_qk_l2norm)
        assert rel_err(o, o_hf_rec[b]) < 1e-5 and rel_err(s, s_hf_rec[b]) < 1e-5


def test_fresh_sequence_state_is_zeros_and_inputs_are_not_modified():
    q, k, v, g, beta = delta_inputs(70, seed=8)
    s0 = torch.zeros(HV, DK, DV)
    before = [x.clone() for x in (q, k, v, g, beta, s0)]
    o_none, s_none = gated_delta_rule_chunked(q, k, v, g, beta, None, use_qk_l2norm=True)
    o_zero, s_zero = gated_delta_rule_chunked(q, k, v, g, beta, s0, use_qk_l2norm=True)
    assert torch.equal(o_none, o_zero) and torch.equal(s_none, s_zero)
    for x, y in zip((q, k, v, g, beta, s0), before):
        assert torch.equal(x, y)
    o_hf, s_hf = hf_chunk(*(x[None] for x in (q, k, v, g, beta)), output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
    assert rel_err(o_none, o_hf[0]) < 1e-5 and rel_err(s_none, s_hf[0]) < 1e-5


def test_empty_prefill_returns_the_state_unchanged():
    q, k, v, g, beta = delta_inputs(0)
    s0 = random_state()
    for fn in (gated_delta_rule_chunked, gated_delta_rule_recurrent):
        o, s = fn(q, k, v, g, beta, s0, use_qk_l2norm=True)
        assert o.shape == (0, HV, DV) and torch.equal(s, s0)


def test_l2norm_and_gates_match_transformers():
    x = torch.randn(5, 3, 16)
    torch.testing.assert_close(l2norm(x), qwen3_next.l2norm(x, dim=-1, eps=1e-6), rtol=0, atol=0)
    a, b = torch.randn(6, HV), torch.randn(6, HV)
    A_log, dt_bias = torch.rand(HV).log(), torch.randn(HV)
    g, beta = deltanet_gates(a, b, A_log, dt_bias)
    torch.testing.assert_close(g, -A_log.exp() * F.softplus(a + dt_bias))
    torch.testing.assert_close(beta, torch.sigmoid(b))
    assert (g <= 0).all()


# -- causal conv ---------------------------------------------------------------

C, W = 24, 4


def conv_inputs(t: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t, C, generator=gen), torch.randn(C, W, generator=gen) * 0.5


@pytest.mark.parametrize("t", [1, 2, 3, 4, 17])
def test_conv_prefill_of_a_fresh_sequence_matches_transformers(t):
    x, w = conv_inputs(t, seed=t)
    y, state = causal_conv1d_prefill(x, w)
    y_hf = qwen3_next.causal_conv1d_fn(x.T[None], w, None, activation="silu")[0].T
    torch.testing.assert_close(y, y_hf, rtol=1e-6, atol=1e-6)
    padded = torch.cat([torch.zeros(W - 1, C), x])
    assert torch.equal(state, padded[-(W - 1):].T)


@pytest.mark.parametrize("split", [1, 2, 5, 16])
def test_conv_prefill_continues_from_its_state(split):
    x, w = conv_inputs(20, seed=split)
    y_full, state_full = causal_conv1d_prefill(x, w)
    y1, state = causal_conv1d_prefill(x[:split], w)
    y2, state = causal_conv1d_prefill(x[split:], w, state)
    torch.testing.assert_close(torch.cat([y1, y2]), y_full, rtol=1e-6, atol=1e-6)
    assert torch.equal(state, state_full)


def test_conv_prefill_then_decode_updates_equal_conv_over_the_whole_sequence():
    """Three sequences with different prompt lengths decode together from a slot pool."""
    lengths, prompt = [30, 9, 2], [5, 1, 2]
    seqs = [conv_inputs(n, seed=i)[0] for i, n in enumerate(lengths)]
    _, w = conv_inputs(1)
    pool = torch.full((6, C, W - 1), float("nan"))  # rows no sequence owns stay NaN
    slots = torch.tensor([4, 0, 2])
    outs = []
    for x, p, slot in zip(seqs, prompt, slots):
        y, pool[slot] = causal_conv1d_prefill(x[:p], w)
        outs.append([y])
    for step in range(max(n - p for n, p in zip(lengths, prompt))):
        live = [i for i in range(3) if prompt[i] + step < lengths[i]]
        x = torch.stack([seqs[i][prompt[i] + step] for i in live])
        y = causal_conv1d_update(x, w, pool, slots[live])
        for row, i in enumerate(live):
            outs[i].append(y[row:row + 1])
    for x, out in zip(seqs, outs):
        torch.testing.assert_close(torch.cat(out), causal_conv1d_prefill(x, w)[0], rtol=1e-6, atol=1e-6)
    assert pool[[1, 3, 5]].isnan().all()


def test_conv_update_matches_transformers_and_skips_padding_rows():
    gen = torch.Generator().manual_seed(9)
    x, w = torch.randn(3, C, generator=gen), torch.randn(C, W, generator=gen)
    state = torch.randn(3, C, W - 1, generator=gen)
    hf_state = state.clone()
    y_hf = qwen3_next.causal_conv1d_update(x[:, :, None], hf_state, w, None, "silu")[:, :, 0]
    ours = state.clone()
    y = causal_conv1d_update(x, w, ours)
    torch.testing.assert_close(y, y_hf, rtol=1e-6, atol=1e-6)
    assert torch.equal(ours, hf_state)
    pool = state[[2, 1, 0]].clone()  # sequence 0 lives in slot 2, sequence 2 in slot 0
    y = causal_conv1d_update(x, w, pool, torch.tensor([2, -1, 0]))
    assert torch.equal(y[1], torch.zeros(C)) and torch.equal(pool[1], state[1])
    torch.testing.assert_close(y[[0, 2]], y_hf[[0, 2]], rtol=1e-6, atol=1e-6)
    assert torch.equal(pool[2], hf_state[0]) and torch.equal(pool[0], hf_state[2])


# -- decode and the whole core -------------------------------------------------


def test_decode_updates_pool_slots_in_place_like_the_recurrence():
    b, slots = 3, torch.tensor([5, -1, 1, 2])  # row 1 is padding
    q, k, v, g, beta = (x[:, 0] for x in delta_inputs(1, seed=10, batch=(b + 1,)))
    pool = random_state(seed=11, batch=(6,))
    before = pool.clone()
    o = gated_delta_rule_decode(q, k, v, g, beta, pool, slots, use_qk_l2norm=True)
    assert o.shape == (b + 1, HV, DV) and torch.equal(o[1], torch.zeros(HV, DV))
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        o_ref, s_ref = gated_delta_rule_recurrent(q[row:row + 1], k[row:row + 1], v[row:row + 1],
                                                  g[row:row + 1], beta[row:row + 1], before[slot],
                                                  use_qk_l2norm=True)
        torch.testing.assert_close(o[row], o_ref[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(pool[slot], s_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(pool[[0, 3, 4]], before[[0, 3, 4]])


def test_decode_without_slots_updates_the_batch_states():
    q, k, v, g, beta = (x[:, 0] for x in delta_inputs(1, seed=12, batch=(2,)))
    states = random_state(seed=13, batch=(2,))
    o_hf, s_hf = hf_recurrent(*(x[:, None] for x in (q, k, v, g, beta)), initial_state=states,
                              output_final_state=True, use_qk_l2norm_in_kernel=True)
    o = gated_delta_rule_decode(q, k, v, g, beta, states, use_qk_l2norm=True)
    assert rel_err(o, o_hf[:, 0]) < 1e-5 and rel_err(states, s_hf) < 1e-5


def deltanet_core(x, w_conv, a, b, A_log, dt_bias, conv_state=None, state=None, split=(HK * DK, HK * DK)):
    """Conv over [q | k | v] channels, then gates and the chunked rule: the layer minus projections."""
    y, conv_state = causal_conv1d_prefill(x, w_conv, conv_state)
    q, k, v = torch.split(y, [*split, y.shape[1] - sum(split)], dim=1)
    t = x.shape[0]
    g, beta = deltanet_gates(a, b, A_log, dt_bias)
    o, state = gated_delta_rule_chunked(q.reshape(t, HK, DK), k.reshape(t, HK, DK), v.reshape(t, HV, DV), g, beta,
                                        state, use_qk_l2norm=True)
    return o, conv_state, state


@pytest.mark.parametrize("split", [1, 40, 64, 129])
def test_prefill_in_two_parts_carrying_conv_and_recurrent_state_equals_one_pass(split):
    t, channels = 200, 2 * HK * DK + HV * DV
    gen = torch.Generator().manual_seed(split)
    x = torch.randn(t, channels, generator=gen)
    w_conv = torch.randn(channels, W, generator=gen) * 0.5
    a, b = torch.randn(t, HV, generator=gen), torch.randn(t, HV, generator=gen)
    A_log, dt_bias = torch.rand(HV, generator=gen).log(), torch.randn(HV, generator=gen)
    o_full, conv_full, s_full = deltanet_core(x, w_conv, a, b, A_log, dt_bias)
    o1, conv, s = deltanet_core(x[:split], w_conv, a[:split], b[:split], A_log, dt_bias)
    o2, conv, s = deltanet_core(x[split:], w_conv, a[split:], b[split:], A_log, dt_bias, conv, s)
    assert rel_err(torch.cat([o1, o2]), o_full) < 1e-5
    assert torch.equal(conv, conv_full) and rel_err(s, s_full) < 1e-5


def test_chunked_prefill_then_decode_steps_equal_one_recurrence():
    q, k, v, g, beta = delta_inputs(90, seed=14)
    o_ref, s_ref = gated_delta_rule_recurrent(q, k, v, g, beta, None, use_qk_l2norm=True)
    o_pre, s = gated_delta_rule_chunked(q[:70], k[:70], v[:70], g[:70], beta[:70], use_qk_l2norm=True)
    pool = s[None].clone()
    outs = [o_pre]
    for t in range(70, 90):
        outs.append(gated_delta_rule_decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], pool,
                                            use_qk_l2norm=True))
    assert rel_err(torch.cat(outs), o_ref) < 1e-5 and rel_err(pool[0], s_ref) < 1e-5
