"""Gated DeltaNet (Qwen3-Next's linear attention) on CUDA.

Own Triton kernels for the per-token work, which is memory-bound and simple:

- `deltanet_gates`: g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b)
  in one elementwise pass (the reference takes seven torch ops);
- `causal_conv1d_prefill`: depthwise causal conv + SiLU over one sequence's new
  tokens, reading the W-1 earlier inputs from its conv state; a second output
  is the new conv state;
- `causal_conv1d_update`: one decode token per sequence, conv states updated in
  place in their pool rows (state slots; slot < 0 is a padding row);
- `gated_delta_rule_decode`: the recurrence for one token per sequence over the
  pool of fp32 states [N, Hv, K, V], updated in place. A program owns one
  (sequence, value head, BLOCK_V columns) piece of S: [K, BLOCK_V] in
  registers, read once and written once, so a decode step moves the state
  bytes twice and nothing else of size;
- `causal_conv1d_verify`, `gated_delta_rule_verify`: a verify step's positions of
  one sequence (its last token and its drafts) in one launch each, the decode
  kernels' arithmetic position after position, each position's state also
  stored to its draft slot (speculative decoding keeps them: kv/cache.py);
  before, the model looped the decode ops and two state copies per position;
- `gated_delta_rule_chunked` (prefill, chunk 64): fla-core's
  `chunk_gated_delta_rule` (flash-linear-attention's Triton kernels: WY
  representation, chunk-parallel intra-chunk work, one sequential pass over
  chunks for the state). Writing that well is a project of its own and fla is
  well kept; it is imported lazily, so the CPU path never imports it. fp32
  inputs take the reference's chunked form instead: fla's triangular solve
  multiplies in TF32 on Hopper, which is not fp32.

Every op keeps the contract of its `reference` twin (shapes in the docstrings),
including which inputs it modifies. No op here syncs with the host.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from radianced.kernels import reference

# -- heuristics ------------------------------------------------------------------------------------


def _decode_block_v(v: int, programs_per_column_block: int) -> int:
    """Columns of S per decode program: 32, or 16 when the batch is too small to fill an H200 (132 SMs)."""
    block_v = 32 if programs_per_column_block * triton.cdiv(v, 32) >= 256 else 16
    return min(block_v, triton.next_power_of_2(v))


# -- kernels ---------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["n"])
def _gates_kernel(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, n, H: tl.constexpr,
                  BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    h = i % H
    a = tl.load(a_ptr + i, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + i, mask=ok, other=0.0).to(tl.float32)
    x = a + tl.load(dt_bias_ptr + h, mask=ok, other=0.0).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's threshold 20
    g = -tl.exp(tl.load(a_log_ptr + h, mask=ok, other=0.0).to(tl.float32)) * softplus
    tl.store(g_ptr + i, g, mask=ok)
    tl.store(beta_ptr + i, tl.sigmoid(b).to(beta_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["T"])
def _conv_prefill_kernel(x_ptr, w_ptr, state_ptr, y_ptr, new_state_ptr, T, C,
                         stride_xt, stride_wc, stride_sc, stride_yt,
                         HAS_STATE: tl.constexpr, W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                         BLOCK_W: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok = t < T
    c_ok = c < C
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for j in tl.static_range(W):
        src = t - (W - 1) + j  # input row of tap j; < 0: state column W - 1 + src
        w = tl.load(w_ptr + c * stride_wc + j, mask=c_ok, other=0.0).to(tl.float32)
        val = tl.load(x_ptr + src[:, None].to(tl.int64) * stride_xt + c[None, :],
                      mask=((src >= 0) & t_ok)[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        if HAS_STATE:
            val += tl.load(state_ptr + c[None, :] * stride_sc + (W - 1 + src)[:, None],
                           mask=((src < 0) & t_ok)[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        acc += val * w[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + t[:, None].to(tl.int64) * stride_yt + c[None, :], y.to(y_ptr.dtype.element_ty),
             mask=t_ok[:, None] & c_ok[None, :])
    if tl.program_id(0) == 0:  # the new state: the last W-1 inputs of state ++ x
        i = tl.arange(0, BLOCK_W)
        i_ok = i < W - 1
        last = T - (W - 1) + i  # input row of state column i; < 0: old state column W - 1 + last
        keep = tl.load(x_ptr + last[None, :].to(tl.int64) * stride_xt + c[:, None],
                       mask=((last >= 0) & i_ok)[None, :] & c_ok[:, None], other=0.0).to(tl.float32)
        if HAS_STATE:
            keep += tl.load(state_ptr + c[:, None] * stride_sc + (W - 1 + last)[None, :],
                            mask=((last < 0) & i_ok)[None, :] & c_ok[:, None], other=0.0).to(tl.float32)
        tl.store(new_state_ptr + c[:, None] * (W - 1) + i[None, :], keep.to(new_state_ptr.dtype.element_ty),
                 mask=c_ok[:, None] & i_ok[None, :])


@triton.jit
def _conv_update_kernel(x_ptr, w_ptr, state_ptr, slots_ptr, y_ptr, C,
                        stride_xb, stride_wc, stride_sn, stride_sc, stride_yb,
                        USE_SLOTS: tl.constexpr, W: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    slot = b.to(tl.int64)
    if USE_SLOTS:
        slot = tl.load(slots_ptr + b).to(tl.int64)
    if slot < 0:  # padding row: zero output, no state touched
        tl.store(y_ptr + b.to(tl.int64) * stride_yb + c, tl.zeros([BLOCK_C], tl.float32).to(y_ptr.dtype.element_ty),
                 mask=c_ok)
        return
    i = tl.arange(0, BLOCK_W)  # window position; W - 1 is the new token
    rows = state_ptr + slot * stride_sn + c[:, None] * stride_sc
    win = tl.load(rows + i[None, :], mask=c_ok[:, None] & (i < W - 1)[None, :], other=0.0).to(tl.float32)
    x = tl.load(x_ptr + b.to(tl.int64) * stride_xb + c, mask=c_ok, other=0.0).to(tl.float32)
    win = tl.where((i == W - 1)[None, :], x[:, None], win)
    w = tl.load(w_ptr + c[:, None] * stride_wc + i[None, :], mask=c_ok[:, None] & (i < W)[None, :], other=0.0)
    acc = tl.sum(win * w.to(tl.float32), 1)
    tl.store(y_ptr + b.to(tl.int64) * stride_yb + c, (acc * tl.sigmoid(acc)).to(y_ptr.dtype.element_ty), mask=c_ok)
    # shift: state column i - 1 <- window position i
    tl.store(rows + (i - 1)[None, :], win.to(state_ptr.dtype.element_ty),
             mask=c_ok[:, None] & ((i >= 1) & (i < W))[None, :])


@triton.jit
def _delta_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, o_ptr, scale,
                         stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_gb, stride_bb,
                         stride_sn, stride_sh, stride_sk, stride_ob, stride_oh,
                         GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, USE_SLOTS: tl.constexpr,
                         L2NORM: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = dv < V
    b64 = b.to(tl.int64)
    o_dst = o_ptr + b64 * stride_ob + h * stride_oh + dv
    slot = b64
    if USE_SLOTS:
        slot = tl.load(slots_ptr + b).to(tl.int64)
    if slot < 0:  # padding row: zero output, no state touched
        tl.store(o_dst, tl.zeros([BLOCK_V], tl.float32).to(o_ptr.dtype.element_ty), mask=v_ok)
        return
    hk = h // GROUP  # the key head this value head reads (repeat_interleave)
    dk = tl.arange(0, BLOCK_K)
    k_ok = dk < K
    q = tl.load(q_ptr + b64 * stride_qb + hk * stride_qh + dk, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b64 * stride_kb + hk * stride_kh + dk, mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b64 * stride_vb + h * stride_vh + dv, mask=v_ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b64 * stride_gb + h).to(tl.float32)
    beta = tl.load(beta_ptr + b64 * stride_bb + h).to(tl.float32)
    s_ptrs = state_ptr + slot * stride_sn + h * stride_sh + dk[:, None] * stride_sk + dv[None, :]
    s_mask = k_ok[:, None] & v_ok[None, :]
    s, o = _delta_token(tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32), q, k, v, g, beta, scale, L2NORM)
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=s_mask)
    tl.store(o_dst, o.to(o_ptr.dtype.element_ty), mask=v_ok)


@triton.jit
def _delta_token(s, q, k, v, g, beta, scale, L2NORM: tl.constexpr):
    """One token of the gated delta rule on a program's piece of S ([K, BLOCK_V], fp32) for q, k [K],
    v [BLOCK_V] and the head's g, beta: (the new piece, o [BLOCK_V]). The decode and verify kernels' one
    arithmetic, so a verify step's positions are plain decoding's bit for bit."""
    if L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    q = q * scale
    s = s * tl.exp(g)
    delta = beta * (v - tl.sum(s * k[:, None], 0))
    s += k[:, None] * delta[None, :]
    return s, tl.sum(s * q[:, None], 0)


@triton.jit(do_not_specialize=["first_draft", "drafts_per_seq"])
def _conv_verify_kernel(x_ptr, w_ptr, state_ptr, starts_ptr, slots_ptr, y_ptr, C, first_draft, drafts_per_seq,
                        stride_xt, stride_wc, stride_sn, stride_sc, stride_yt,
                        W: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
    """`_conv_update_kernel`'s step for each of sequence program_id(1)'s positions in turn (none where its
    slot is < 0), its row shifted in place after each and copied to the position's draft row (all but
    the last)."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    seq = tl.program_id(1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    lo = tl.load(starts_ptr + seq).to(tl.int64)
    t = tl.where(slot >= 0, tl.load(starts_ptr + seq + 1) - lo, 0)
    c_ok = c < C
    i = tl.arange(0, BLOCK_W)  # window position; W - 1 is the new token
    rows = state_ptr + slot * stride_sn + c[:, None] * stride_sc
    w = tl.load(w_ptr + c[:, None] * stride_wc + i[None, :], mask=c_ok[:, None] & (i < W)[None, :], other=0.0)
    shifted = c_ok[:, None] & ((i >= 1) & (i < W))[None, :]
    for j in range(t):
        win = tl.load(rows + i[None, :], mask=c_ok[:, None] & (i < W - 1)[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + (lo + j) * stride_xt + c, mask=c_ok, other=0.0).to(tl.float32)
        win = tl.where((i == W - 1)[None, :], x[:, None], win)
        acc = tl.sum(win * w.to(tl.float32), 1)
        tl.store(y_ptr + (lo + j) * stride_yt + c, (acc * tl.sigmoid(acc)).to(y_ptr.dtype.element_ty), mask=c_ok)
        tl.debug_barrier()  # the row is read by every thread before it is shifted
        tl.store(rows + (i - 1)[None, :], win.to(state_ptr.dtype.element_ty), mask=shifted)
        if j < t - 1:
            draft = state_ptr + (first_draft + slot * drafts_per_seq + j) * stride_sn + c[:, None] * stride_sc
            tl.store(draft + (i - 1)[None, :], win.to(state_ptr.dtype.element_ty), mask=shifted)
        tl.debug_barrier()  # the shifted row is written before the next position reads it


@triton.jit(do_not_specialize=["first_draft", "drafts_per_seq"])
def _delta_verify_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, starts_ptr, slots_ptr, o_ptr, scale,
                         first_draft, drafts_per_seq, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_gt, stride_bt, stride_sn, stride_sh, stride_sk, stride_ot, stride_oh,
                         GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, L2NORM: tl.constexpr):
    """`_delta_decode_kernel`'s step for each of sequence program_id(2)'s positions in turn (none where its
    slot is < 0), its piece of S kept in registers (rounded to the state's dtype between positions, as a
    store and load would) and stored to the position's draft row (all but the last), then to the
    sequence's row."""
    h = tl.program_id(0)
    dv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    seq = tl.program_id(2)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    lo = tl.load(starts_ptr + seq).to(tl.int64)
    t = tl.where(slot >= 0, tl.load(starts_ptr + seq + 1) - lo, 0)
    v_ok = dv < V
    hk = h // GROUP  # the key head this value head reads (repeat_interleave)
    dk = tl.arange(0, BLOCK_K)
    k_ok = dk < K
    s_off = h * stride_sh + dk[:, None] * stride_sk + dv[None, :]
    s_mask = k_ok[:, None] & v_ok[None, :] & (t > 0)
    s = tl.load(state_ptr + slot * stride_sn + s_off, mask=s_mask, other=0.0).to(tl.float32)
    for j in range(t):
        r = lo + j
        q = tl.load(q_ptr + r * stride_qt + hk * stride_qh + dk, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + r * stride_kt + hk * stride_kh + dk, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + r * stride_vt + h * stride_vh + dv, mask=v_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + r * stride_gt + h).to(tl.float32)
        beta = tl.load(beta_ptr + r * stride_bt + h).to(tl.float32)
        s, o = _delta_token(s, q, k, v, g, beta, scale, L2NORM)
        tl.store(o_ptr + r * stride_ot + h * stride_oh + dv, o.to(o_ptr.dtype.element_ty), mask=v_ok)
        s = s.to(state_ptr.dtype.element_ty).to(tl.float32)  # as a store and a load between decode steps
        if j < t - 1:
            tl.store(state_ptr + (first_draft + slot * drafts_per_seq + j) * stride_sn + s_off,
                     s.to(state_ptr.dtype.element_ty), mask=s_mask)
    tl.store(state_ptr + slot * stride_sn + s_off, s.to(state_ptr.dtype.element_ty), mask=s_mask)


# -- checks ----------------------------------------------------------------------------------------


def _slots(slots: torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor | None:
    if slots is None:
        return None
    if slots.shape != (batch,) or slots.device != device or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be an integer [{batch}] tensor on {device}, got {slots.dtype} "
                         f"{tuple(slots.shape)} on {slots.device}")
    return slots.contiguous()


def _check_conv_pool(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, rows: str) -> None:
    """ValueError unless x: [R, C] (`rows` names R: decode's sequences B, verify's positions T) for weight
    [C, W], and conv_state a pool [N, C, W-1] with a contiguous last dim."""
    c, w = weight.shape
    if x.dim() != 2 or x.shape[1] != c:
        raise ValueError(f"x must be [{rows}, {c}] (the conv weight's channels), got {tuple(x.shape)}")
    if conv_state.dim() != 3 or conv_state.shape[1:] != (c, w - 1) or conv_state.stride(2) != 1:
        raise ValueError(f"conv_state must be [N, {c}, {w - 1}] with a contiguous last dim, "
                         f"got {tuple(conv_state.shape)}")


def _check_delta_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor) -> None:
    """ValueError unless q, k: [R, Hk, K]; v: [R, Hv, V] (Hv a multiple of Hk); g, beta: [R, Hv]; state
    [N, Hv, K, V] with a contiguous last dim (R rows: decode's sequences, or verify's positions)."""
    rows, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != rows or hv % hk:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: q and k must match and "
                         f"value heads ({hv}) be a multiple of key heads ({hk})")
    if g.shape != (rows, hv) or beta.shape != (rows, hv):
        raise ValueError(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be [{rows}, {hv}]")
    if state.dim() != 4 or state.shape[1:] != (hv, dk, dv) or state.stride(3) != 1:
        raise ValueError(f"state must be [N, {hv}, {dk}, {dv}] with a contiguous last dim, got {tuple(state.shape)}")


def _last_dim_contiguous(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


# -- public ops ------------------------------------------------------------------------------------


def deltanet_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                   dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-decay and write strength (Triton). a, b: [..., Hv]; A_log, dt_bias: [Hv].

    Same contract as `reference.deltanet_gates`: g = -exp(A_log) * softplus(a + dt_bias)
    in fp32 (new tensor, a's shape) and beta = sigmoid(b) in b's dtype.
    """
    hv = A_log.shape[0]
    if a.shape != b.shape or a.shape[-1] != hv or dt_bias.shape != (hv,):
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} must be [..., {hv}] (A_log's heads), "
                         f"dt_bias [{hv}], got dt_bias {tuple(dt_bias.shape)}")
    a, b, A_log, dt_bias = (x.contiguous() for x in (a, b, A_log, dt_bias))
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(b)
    n = a.numel()
    if n:
        block = 1024
        _gates_kernel[(triton.cdiv(n, block),)](a, b, A_log, dt_bias, g, beta, n, H=hv, BLOCK=block, num_warps=4)
    return g, beta


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor,
                          conv_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over one sequence's new tokens (Triton).

    Same contract as `reference.causal_conv1d_prefill`: x: [T, C]; weight: [C, W];
    conv_state: [C, W-1] (oldest input first) or None (zeros). Returns y: [T, C]
    in x's dtype and a new conv state [C, W-1] in conv_state's dtype (x's when
    None). Nothing is modified in place.
    """
    c, w = weight.shape
    if x.dim() != 2 or x.shape[1] != c:
        raise ValueError(f"x must be [T, {c}] (the conv weight's channels), got {tuple(x.shape)}")
    if conv_state is not None and conv_state.shape != (c, w - 1):
        raise ValueError(f"conv_state must be [{c}, {w - 1}], got {tuple(conv_state.shape)}")
    x, weight = _last_dim_contiguous(x, weight)
    state = None if conv_state is None else conv_state.contiguous()
    t = x.shape[0]
    y = torch.empty((t, c), dtype=x.dtype, device=x.device)
    new_state = torch.empty((c, w - 1), dtype=x.dtype if state is None else state.dtype, device=x.device)
    block_t, block_c = 16, 128
    grid = (max(1, triton.cdiv(t, block_t)), triton.cdiv(c, block_c))
    _conv_prefill_kernel[grid](
        x, weight, x if state is None else state, y, new_state, t, c,
        x.stride(0), weight.stride(0), 0 if state is None else state.stride(0), y.stride(0),
        HAS_STATE=state is not None, W=w, BLOCK_T=block_t, BLOCK_C=block_c,
        BLOCK_W=triton.next_power_of_2(max(w - 1, 1)), num_warps=4,
    )
    return y, new_state


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                         slots: torch.Tensor | None = None) -> torch.Tensor:
    """One decode token per sequence: depthwise causal conv + SiLU, state updated in place (Triton).

    Same contract as `reference.causal_conv1d_update`: x: [B, C]; weight: [C, W];
    conv_state [B, C, W-1] (row b is sequence b's), or with `slots` [B] (int, on
    x's device) a pool [N, C, W-1] where sequence b owns row slots[b]; slots
    distinct, slot < 0 a padding row (zero output, no state touched). conv_state
    needs a contiguous last dim. Returns y: [B, C] in x's dtype.
    """
    c, w = weight.shape
    batch = x.shape[0]
    _check_conv_pool(x, weight, conv_state, "B")
    if slots is None and conv_state.shape[0] != batch:
        raise ValueError(f"without slots conv_state needs one row per sequence ({batch}), has {conv_state.shape[0]}")
    slots = _slots(slots, batch, x.device)
    x, weight = _last_dim_contiguous(x, weight)
    y = torch.empty((batch, c), dtype=x.dtype, device=x.device)
    if batch == 0:
        return y
    block_c = 256
    _conv_update_kernel[(batch, triton.cdiv(c, block_c))](
        x, weight, conv_state, x if slots is None else slots, y, c,
        x.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1), y.stride(0),
        USE_SLOTS=slots is not None, W=w, BLOCK_C=block_c, BLOCK_W=triton.next_power_of_2(w), num_warps=4,
    )
    return y


def gated_delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor | None = None, *,
                            use_qk_l2norm: bool = False, scale: float | None = None) -> torch.Tensor:
    """One decode token for each of B sequences; their recurrent states updated in place (Triton).

    Same contract as `reference.gated_delta_rule_decode`: q, k: [B, Hk, K];
    v: [B, Hv, V] (Hv a multiple of Hk; each last dim contiguous, other strides
    free); g, beta: [B, Hv]; state [B, Hv, K, V], or with `slots` [B] (int, on
    q's device) a pool [N, Hv, K, V] where sequence b owns state[slots[b]]; slots
    distinct, slot < 0 a padding row (zero output, no state touched). state
    (fp32 in the product) needs a contiguous last dim. Returns o: [B, Hv, V] in
    q's dtype.
    """
    batch, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    _check_delta_inputs(q, k, v, g, beta, state)
    if slots is None and state.shape[0] != batch:
        raise ValueError(f"without slots state needs one row per sequence ({batch}), has {state.shape[0]}")
    slots = _slots(slots, batch, q.device)
    q, k, v, g, beta = _last_dim_contiguous(q, k, v, g, beta)
    o = torch.empty((batch, hv, dv), dtype=q.dtype, device=q.device)
    if batch == 0:
        return o
    block_v = _decode_block_v(dv, batch * hv)
    _delta_decode_kernel[(batch, hv, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, state, q if slots is None else slots, o, dk ** -0.5 if scale is None else scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        state.stride(0), state.stride(1), state.stride(2), o.stride(0), o.stride(1),
        GROUP=hv // hk, K=dk, V=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v,
        USE_SLOTS=slots is not None, L2NORM=use_qk_l2norm, num_warps=4,
    )
    return o


def _verify_rows(query_start: torch.Tensor, slots: torch.Tensor, tokens: int, device: torch.device) -> None:
    if query_start.dim() != 1 or slots.shape != (query_start.shape[0] - 1,) or query_start.dtype != torch.int32 \
            or slots.dtype not in (torch.int32, torch.int64) or query_start.device != device or slots.device != device:
        raise ValueError(f"query_start must be an int32 [B+1] tensor and slots an integer [B] tensor, both on "
                         f"{device}, got {query_start.dtype} {tuple(query_start.shape)} on {query_start.device} and "
                         f"{slots.dtype} {tuple(slots.shape)} on {slots.device} ({tokens} rows)")


def causal_conv1d_verify(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, query_start: torch.Tensor,
                         slots: torch.Tensor, first_draft: int, drafts_per_seq: int) -> torch.Tensor:
    """A step's verify-shaped sequences, each sequence's positions in turn, all in one launch (Triton).
    Same contract as `reference.causal_conv1d_verify`: x: [T, C], sequence b's rows query_start[b]:
    query_start[b+1] (an int32 [B+1] device tensor, read by the kernel: no host sync, capturable);
    weight: [C, W]; conv_state a pool [N, C, W-1] (a contiguous last dim); slots [B]: each sequence's
    row, or < 0 for a sequence left alone (its rows of y unwritten); the state after position j of a
    sequence but its last also in row first_draft + slots[b] * drafts_per_seq + j. Returns y: [T, C]
    in x's dtype."""
    c, w = weight.shape
    _check_conv_pool(x, weight, conv_state, "T")
    _verify_rows(query_start, slots, x.shape[0], x.device)
    x, weight = _last_dim_contiguous(x, weight)
    y = torch.empty((x.shape[0], c), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0 or slots.shape[0] == 0:
        return y
    block_c = 256
    _conv_verify_kernel[(triton.cdiv(c, block_c), slots.shape[0])](
        x, weight, conv_state, query_start, slots, y, c, first_draft, drafts_per_seq,
        x.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1), y.stride(0),
        W=w, BLOCK_C=block_c, BLOCK_W=triton.next_power_of_2(w), num_warps=4,
    )
    return y


def gated_delta_rule_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            state: torch.Tensor, query_start: torch.Tensor, slots: torch.Tensor, first_draft: int,
                            drafts_per_seq: int, *, use_qk_l2norm: bool = False,
                            scale: float | None = None) -> torch.Tensor:
    """A step's verify-shaped sequences, each sequence's positions in turn, all in one launch (Triton).
    Same contract as `reference.gated_delta_rule_verify`: q, k: [T, Hk, K]; v: [T, Hv, V] (each last
    dim contiguous); g, beta: [T, Hv]; sequence b's rows query_start[b]:query_start[b+1]; state a pool
    [N, Hv, K, V] (a contiguous last dim); slots [B]: each sequence's row, or < 0 for a sequence left
    alone (its rows of o unwritten); the state after position j of a sequence but its last also in row
    first_draft + slots[b] * drafts_per_seq + j. Returns o: [T, Hv, V] in q's dtype."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    _check_delta_inputs(q, k, v, g, beta, state)
    _verify_rows(query_start, slots, t, q.device)
    q, k, v, g, beta = _last_dim_contiguous(q, k, v, g, beta)
    o = torch.empty((t, hv, dv), dtype=q.dtype, device=q.device)
    if t == 0 or slots.shape[0] == 0:
        return o
    block_v = _decode_block_v(dv, hv)
    _delta_verify_kernel[(hv, triton.cdiv(dv, block_v), slots.shape[0])](
        q, k, v, g, beta, state, query_start, slots, o, dk ** -0.5 if scale is None else scale, first_draft,
        drafts_per_seq, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        beta.stride(0), state.stride(0), state.stride(1), state.stride(2), o.stride(0), o.stride(1),
        GROUP=hv // hk, K=dk, V=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v,
        L2NORM=use_qk_l2norm, num_warps=4,
    )
    return o


@functools.cache
def _fla_chunk():
    """fla-core's chunk_gated_delta_rule, imported on first use (never on the CPU path)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        raise ImportError(f"the Gated DeltaNet prefill on CUDA needs fla-core ({e}): install radianced[gpu] "
                          "(pip install 'fla-core==0.6.0'), or on the device carry the wheel that "
                          "tools/fetch_wheels.sh downloads") from e
    return chunk_gated_delta_rule


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor | None = None, *,
                             use_qk_l2norm: bool = False, scale: float | None = None,
                             chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence in chunks (prefill): fla-core's kernels for bf16/fp16.

    Same contract as `reference.gated_delta_rule_chunked`: q, k: [T, Hk, K];
    v: [T, Hv, V]; g (fp32 log-decay), beta: [T, Hv]; state: [Hv, K, V] or None.
    Returns o: [T, Hv, V] in q's dtype and the final state [Hv, K, V] fp32;
    `state` is not modified. fp32 inputs run the reference (IEEE products).
    """
    if q.dtype == torch.float32 or q.shape[0] == 0:
        return reference.gated_delta_rule_chunked(q, k, v, g, beta, state, use_qk_l2norm=use_qk_l2norm,
                                                  scale=scale, chunk_size=chunk_size)
    h0 = None if state is None else state.float().contiguous()[None]
    o, final = _fla_chunk()(q[None], k[None], v[None], g.float()[None], beta[None], scale=scale,
                            initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
                            chunk_size=chunk_size)
    return o[0].to(q.dtype), final[0].float()


__all__ = ["causal_conv1d_prefill", "causal_conv1d_update", "causal_conv1d_verify", "deltanet_gates",
           "gated_delta_rule_chunked", "gated_delta_rule_decode", "gated_delta_rule_verify"]
