"""The fp32 torch truth for every op.

Each function here is the reference a Triton kernel and the CPU backend's op
(kernels/cpu.py) are tested against; the CPU backend runs the ones it has no op
of its own for. Shapes are in the docstrings; T is the
number of tokens in a step (all sequences flattened), B the number of sequences.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from radianced.kernels.compact import CompactWeight, dense
from radianced.kernels.formats import FORMATS, expert_formats
from radianced.kernels.kv_quant import KVPlane

# -- norms ------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim. x: [..., D], weight: [D].

    Plain (Llama, Qwen3-MoE): normalize in fp32, cast back, then multiply by
    `weight`. Zero-centred (Qwen3-Next): multiply by `1 + weight` in fp32, then cast.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centred:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3-Next DeltaNet output norm: `weight * norm(x) * silu(gate)`. x, gate: [..., D]."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(x.dtype)
    return (out * F.silu(gate.float())).to(x.dtype)


# -- rotary -----------------------------------------------------------------


def rotary_inv_freq(rotary_dim: int, theta: float, device: torch.device | str) -> torch.Tensor:
    """HF's default rope frequencies: [rotary_dim / 2] fp32, theta ** (-2i / rotary_dim)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    return 1.0 / (theta ** exponents)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [T, R] fp32 for integer positions [T] and frequencies [R / 2] (both halves the same)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, R / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first R = 2 * len(inv_freq) dims of x: [T, H, D] at positions [T];
    the rest passes."""
    return _rotate(x, *rotary_cos_sin(positions, inv_freq))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rd = cos.shape[-1]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat((x_rot * c + rotated * s, x_pass), dim=-1)


def rotary_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
              q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
              zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention prologue: per-head RMSNorm of q: [T, Hq, D] and k: [T, Hk, D] when
    q_weight, k_weight ([D]) are given (Qwen3's qk-norm), then `apply_rotary` on both."""
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps, zero_centred), rms_norm(k, k_weight, eps, zero_centred)
    cos, sin = rotary_cos_sin(positions, inv_freq)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


# -- linear -----------------------------------------------------------------


Norm = tuple[torch.Tensor, float, bool]  # an RMSNorm's (weight [D], eps, zero_centred)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, norm: Norm | None = None,
           keep_normed: bool = False, out_dtype: torch.dtype | None = None,
           ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A projection with an optional RMSNorm before it and residual add after it:
    `residual + (rms_norm(x) @ weight^T + bias)`.

    x: [T, K]; weight: [N, K] (or a compact matrix, `kernels/compact.py`, dequantized
    to x's dtype for this call); bias: [N] or None; residual: [T, N] or None; norm:
    (weight [K], eps, zero_centred) as `rms_norm` takes them, or None; all in x's
    dtype. Returns a new [T, N] in x's dtype, converted to `out_dtype` when given (the
    lm_head's fp32 logits), or (that, the normed x [T, K]) with `keep_normed`.
    torch's rounding: F.linear's result is rounded to x's dtype, then the sum with
    the residual is rounded again.
    """
    if norm is not None:
        x = rms_norm(x, *norm)
    y = F.linear(x, dense(weight, x.dtype), bias)
    y = y if residual is None else residual + y
    if out_dtype is not None:
        y = y.to(out_dtype)
    return (y, x) if keep_normed else y


# -- MLP --------------------------------------------------------------------


def silu_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """`down(silu(gate(x)) * up(x))`. x: [T, H]; gate, up: [I, H]; down: [H, I] (dense, or compact
    matrices dequantized to x's dtype one at a time)."""
    gate, up = dense(gate, x.dtype), dense(up, x.dtype)
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), dense(down, x.dtype))


# -- paged KV ---------------------------------------------------------------
# A cache view for one layer is [P, N, S, Hkv, D]: P arena pages of N blocks of
# S tokens. Block id b lives at page b // N, position b % N inside the page.


def write_kv(k_cache: torch.Tensor | KVPlane, v_cache: torch.Tensor | KVPlane, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k, v: [T, Hkv, D] at flat slots [T] (slot = block * S + offset; < 0 = skip), rounded to the
    cache's dtype when it differs (`radiancectl quality --kv-cache-dtype` measures that rounding), or
    quantized into a quantized cache's planes (`KVPlane.store`: kernels/kv_formats.py)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    if isinstance(k_cache, KVPlane):
        k_cache.store(slots, k[keep])
        v_cache.store(slots, v[keep])
        return
    _, n, s = k_cache.shape[:3]
    block, off = slots // s, slots % s
    k_cache[block // n, block % n, off] = k[keep].to(k_cache.dtype)
    v_cache[block // n, block % n, off] = v[keep].to(v_cache.dtype)


def rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
                    zero_centred: bool = False) -> torch.Tensor:
    """The attention prologue up to the cache: `rotary_qk`, then `write_kv` of the rotated k and
    v ([T, Hkv, D]). Returns the rotated q."""
    q, k = rotary_qk(q, k, positions, inv_freq, q_weight, k_weight, eps, zero_centred)
    write_kv(k_cache, v_cache, k, v, slot_mapping)
    return q


def gather_kv(cache: torch.Tensor | KVPlane, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence: [length, Hkv, D], from its block table [nb]; a
    quantized plane's dequantized (fp32), block by block."""
    _, n, s = cache.shape[:3]
    blocks = block_table[: (length + s - 1) // s].long()
    if isinstance(cache, KVPlane):
        return torch.cat([cache.blocks(b) for b in blocks])[:length]
    return cache[blocks // n, blocks % n].flatten(0, 1)[:length]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start, seq_lens, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged context.

    q: [T, Hq, D]; sequence b owns q rows query_start[b]:query_start[b+1], which are
    the last tokens of its seq_lens[b] context tokens (already written to the cache);
    query_start [B+1] and seq_lens [B] are host sequences or integer tensors.
    block_tables: [B, max_blocks]. GQA: Hq is a multiple of Hkv. Returns [T, Hq, D].
    """
    if isinstance(query_start, torch.Tensor):
        query_start, seq_lens = query_start.tolist(), seq_lens.tolist()  # the reference loops on the host
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_cache.shape[3]
    for b, n_ctx in enumerate(seq_lens):
        lo, hi = query_start[b], query_start[b + 1]
        if hi == lo:
            continue
        k = gather_kv(k_cache, block_tables[b], n_ctx).repeat_interleave(hq // hkv, dim=1)  # [C, Hq, D]
        v = gather_kv(v_cache, block_tables[b], n_ctx).repeat_interleave(hq // hkv, dim=1)
        qb = q[lo:hi]  # [Q, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qb.float(), k.float()) * scale
        q_pos = torch.arange(n_ctx - (hi - lo), n_ctx, device=q.device)
        mask = torch.arange(n_ctx, device=q.device)[None, :] > q_pos[:, None]  # [Q, C]
        scores.masked_fill_(mask, float("-inf"))
        probs = scores.softmax(-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
    return out


def dense_layer(layer, x: torch.Tensor, rope, batch, cache) -> None:
    """A whole dense decoder layer in one op (the host backend's, kernels/cpu.py): none here, so the model runs
    the layer's ops."""
    return None


def check_decode(query_start: Sequence[int]) -> None:
    """Raise ValueError unless query_start (on the host) is 0, 1, ..., B: one query row per sequence."""
    if tuple(query_start) != tuple(range(len(query_start))):
        raise ValueError(f"decode=True needs one query row per sequence (query_start 0, 1, ..., B), got "
                         f"query_start {tuple(query_start)}; leave decode off for prefill and mixed steps")


def rotary_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                           inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, block_tables: torch.Tensor, query_start, seq_lens,
                           scale: float, *, q_weight: torch.Tensor | None = None,
                           k_weight: torch.Tensor | None = None, eps: float = 1e-6, zero_centred: bool = False,
                           decode: bool = False) -> torch.Tensor:
    """An attention layer from its projection to its heads' output: `rotary_write_kv` (q: [T, Hq, D],
    k, v: [T, Hkv, D] into the caches at slot_mapping [T]), then `paged_attention` of the rotated q.
    `decode` says every sequence has one query row (query_start is 0, 1, ..., B); checked here.
    Returns [T, Hq, D]."""
    if decode:
        check_decode(query_start.tolist() if isinstance(query_start, torch.Tensor) else query_start)
    q = rotary_write_kv(q, k, v, positions, inv_freq, k_cache, v_cache, slot_mapping, q_weight, k_weight, eps,
                        zero_centred)
    return paged_attention(q, k_cache, v_cache, block_tables, query_start, seq_lens, scale)


# -- embeddings -------------------------------------------------------------


def gather_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` ([T] int) of `table` ([V, H], on any device): [T, H] in the table's dtype on the
    ids' device (the embedding lookup of a table kept away from the compute device)."""
    return F.embedding(ids.to(table.device), table).to(ids.device)


# -- routed experts ---------------------------------------------------------


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] int64: each row's index of its largest value, the first on ties (torch's)."""
    return logits.argmax(dim=-1)


def route(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The router after its matmul: softmax over all E experts in fp32, the top k, optionally
    renormalized to sum to 1. logits: [T, E]. Returns (ids [T, k] int64, weights [T, k] in
    `dtype`), the k in descending order of weight."""
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(dtype)


def moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, table: torch.Tensor,
        slab: torch.Tensor, inter: int, host: torch.Tensor | None = None, *,
        residual: torch.Tensor | None = None, weight_format: str | None = None, mlp=silu_mlp,
        staging: torch.Tensor | None = None) -> torch.Tensor:
    """Routed SiLU experts, tokens grouped by expert, weights found through the table.

    x: [T, H]; topk_ids, topk_weights: [T, k]; table: [E]: entry >= 0 is a row of
    slab [R, 3 * I * H] (a VRAM slot), entry < 0 is row -1 - entry of host
    [R', 3 * I * H] (the host pool: an overflow read). A row = gate [I, H] | up [I, H] | down [H, I].
    Each distinct routed expert's row is read once and applied to all of its
    tokens; outputs are weighted and summed per token. Returns [T, H], or
    `residual + that` when a residual ([T, H]) is given. `weight_format` names the format
    of a byte slab's extents (`formats.expert_formats`: "q4_0", or "q4_k+q6_k" when down
    differs): the rows are then uint8, each extent
    three pieces at the start of its row, a compact piece dequantized to x's dtype when
    its expert runs. `mlp`: the SiLU MLP each expert runs (`silu_mlp` here; the host backend passes its
    own, which reads a compact piece's blocks in place: kernels/cpu.py `moe`). `staging`: rows the
    Triton op may copy host experts into before reading them (kernels/stage.py); here they are
    read where they are, the same bytes.
    """
    t, k = topk_ids.shape
    hidden = x.shape[1]
    experts, inverse = torch.unique(topk_ids.flatten(), return_inverse=True)  # sorted distinct experts
    where = table[experts]
    if host is None:
        rows = slab.index_select(0, where)  # [n, 3IH]: one read per expert per step
    else:
        in_slot = where >= 0
        rows = torch.empty((len(experts), slab.shape[1]), dtype=slab.dtype, device=slab.device)
        rows[in_slot] = slab.index_select(0, where[in_slot])
        rows[~in_slot] = host.index_select(0, -1 - where[~in_slot]).to(slab.device)
    pieces = _expert_pieces(rows, inter, hidden, weight_format)
    order = torch.argsort(inverse, stable=True)  # assignments grouped by expert
    token = order // k
    weight = topk_weights.flatten()[order]
    out = torch.zeros_like(x)
    start = 0
    for i, count in enumerate(torch.bincount(inverse, minlength=len(experts)).tolist()):
        idx = token[start:start + count]
        h = mlp(x[idx], *(piece(i) for piece in pieces))
        out.index_add_(0, idx, h * weight[start:start + count, None])
        start += count
    return out if residual is None else residual + out


def _expert_pieces(rows: torch.Tensor, inter: int, hidden: int, weight_format: str | None):
    """(gate, up, down) getters: row i -> that expert's [I, H], [I, H], [H, I] matrix (a view, or a
    `CompactWeight` over its bytes)."""
    shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
    if weight_format is None:
        gate, up, down = rows.split(inter * hidden, dim=1)
        return tuple(lambda i, p=p, s=s: p[i].view(s) for p, s in zip((gate, up, down), shapes))
    gate_up, down = expert_formats(weight_format)
    fmts = (FORMATS[gate_up], FORMATS[gate_up], FORMATS[down])
    sizes = [f.nbytes(s) for f, s in zip(fmts, shapes)]
    parts = rows[:, :sum(sizes)].split(sizes, dim=1)  # a byte slab's rows may be wider than this layer's extents

    def piece(p: torch.Tensor, f, s: tuple[int, int]):
        if not f.compact:  # a plain layer in a byte slab that also holds compact layers
            return lambda i: p[i].contiguous().view(f.dtype).view(s)
        return lambda i: CompactWeight(f.name, s, p[i])

    return tuple(piece(p, f, s) for p, f, s in zip(parts, fmts, shapes))


def route_moe(x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool, table: torch.Tensor,
              slab: torch.Tensor, inter: int, host: torch.Tensor | None = None, *,
              residual: torch.Tensor | None = None, weight_format: str | None = None, mlp=silu_mlp,
              staging: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`route` then `moe`: the routed experts of router logits [T, E]. Returns (`moe`'s result,
    ids [T, k] int64, weights [T, k] in x's dtype) with ids and weights as `route` returns them."""
    ids, weights = route(logits, top_k, renormalize, x.dtype)
    out = moe(x, ids, weights, table, slab, inter, host, residual=residual, weight_format=weight_format, mlp=mlp)
    return out, ids, weights


# == Gated DeltaNet (Qwen3-Next linear attention) =============================
# Everything below is one sequence at a time (prefill) or one token per sequence
# (decode), fp32 inside. Shapes: T tokens, Hk key heads, Hv value heads (a
# multiple of Hk: value head h reads key head h // (Hv // Hk), as transformers'
# repeat_interleave does), K key dim, V value dim, C conv channels, W conv width.
# The recurrent state of a value head is S: [K, V]; per token
#     S = S * exp(g);  delta = beta * (v - S^T k);  S = S + k delta^T;  o = S^T q
# where q and k are (optionally) L2-normalized and q is scaled by K^-0.5 inside
# these functions, exactly where transformers' torch_*_gated_delta_rule and
# FLA's kernels do it: l2norm first, then the scale. Callers pass raw q and k.


def l2norm(x: torch.Tensor, eps: float = 1e-6, dim: int = -1) -> torch.Tensor:
    """`x / sqrt(sum(x^2) + eps)` along `dim` (transformers' and FLA's form: eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def deltanet_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                   dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-decay and write strength. a, b: [..., Hv]; A_log, dt_bias: [Hv].

    Returns g = -exp(A_log) * softplus(a + dt_bias) (fp32, <= 0) and beta = sigmoid(b)
    (in b's dtype), as Qwen3NextGatedDeltaNet computes them.
    """
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor,
                          conv_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over one sequence's new tokens.

    x: [T, C]; weight: [C, W] (conv1d.weight squeezed; column W-1 meets the current
    token); conv_state: [C, W-1], the inputs of the W-1 tokens before x (oldest
    first), None for a fresh sequence (zeros). Returns y: [T, C] in x's dtype and
    the new conv state [C, W-1] (the last W-1 inputs, earlier state included when
    T < W-1). Nothing is modified in place.
    """
    c, w = weight.shape
    if conv_state is None:
        conv_state = x.new_zeros(c, w - 1)
    xs = torch.cat([conv_state.float().T, x.float()])  # [W-1+T, C]
    windows = xs.unfold(0, w, 1)  # [T, C, W]: windows[t] = inputs t .. t+W-1 (t+W-1 is token t)
    y = F.silu((windows * weight.float()).sum(-1))
    new_state = xs[xs.shape[0] - (w - 1):].T.to(conv_state.dtype)
    return y.to(x.dtype), new_state


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                         slots: torch.Tensor | None = None) -> torch.Tensor:
    """One decode token per sequence: depthwise causal conv + SiLU, state updated in place.

    x: [B, C]; weight: [C, W]. Without `slots`, conv_state is [B, C, W-1] and row b
    is sequence b's state. With `slots` [B] (int), conv_state is a pool [N, C, W-1]
    and sequence b owns row slots[b]; slots must be distinct, and a slot < 0 marks a
    padding row (zero output, no state touched). Returns y: [B, C] in x's dtype.
    """
    batch, rows = _live_rows(slots, x.shape[0], x.device)
    xs = torch.cat([conv_state[rows].float(), x[batch].float()[:, :, None]], dim=-1)  # [B', C, W]
    y = x.new_zeros(x.shape)
    y[batch] = F.silu((xs * weight.float()).sum(-1)).to(x.dtype)
    conv_state[rows] = xs[:, :, 1:].to(conv_state.dtype)
    return y


def causal_conv1d_verify(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, query_start: torch.Tensor,
                         slots: torch.Tensor, first_draft: int, drafts_per_seq: int) -> torch.Tensor:
    """A step's verify-shaped sequences (a verify step's: its last token, then its drafts; or one token):
    `causal_conv1d_update` token by token, so each position's state is the one plain decoding reaches.

    x: [T, C], sequence b's rows query_start[b]:query_start[b+1] ([B+1] int tensor); weight: [C, W];
    conv_state a pool [N, C, W-1] whose row slots[b] ([B] int tensor) is sequence b's, updated in place to
    the state after its last row; a sequence whose slot is < 0 is left alone (its rows of y unwritten).
    The state after each position j of a sequence but its last is also left in row first_draft + slots[b]
    * drafts_per_seq + j (its draft slots, kv/cache.py `draft_slot`). Returns y: [T, C] in x's dtype.
    """
    y = torch.empty_like(x)
    for lo, hi, row in _verify_sequences(query_start, slots):
        slot = slots.new_tensor([row])
        for j in range(lo, hi):
            y[j:j + 1] = causal_conv1d_update(x[j:j + 1], weight, conv_state, slot)
            if j < hi - 1:
                conv_state[first_draft + row * drafts_per_seq + j - lo] = conv_state[row]
    return y


def gated_delta_rule_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            state: torch.Tensor, query_start: torch.Tensor, slots: torch.Tensor, first_draft: int,
                            drafts_per_seq: int, *, use_qk_l2norm: bool = False,
                            scale: float | None = None) -> torch.Tensor:
    """A step's verify-shaped sequences: `gated_delta_rule_decode` token by token, so each position's
    state is the one plain decoding reaches. q, k: [T, Hk, K]; v: [T, Hv, V]; g, beta: [T, Hv]; sequence
    b's rows query_start[b]:query_start[b+1]; state a pool [N, Hv, K, V] whose row slots[b] is sequence
    b's, updated in place to the state after its last row (a slot < 0: left alone, its rows of o
    unwritten); the state after each position j of a sequence but its last also left in row first_draft
    + slots[b] * drafts_per_seq + j. Returns o: [T, Hv, V] in q's dtype."""
    o = q.new_empty(v.shape)
    for lo, hi, row in _verify_sequences(query_start, slots):
        slot = slots.new_tensor([row])
        for j in range(lo, hi):
            o[j:j + 1] = gated_delta_rule_decode(q[j:j + 1], k[j:j + 1], v[j:j + 1], g[j:j + 1], beta[j:j + 1], state,
                                                 slot, use_qk_l2norm=use_qk_l2norm, scale=scale)
            if j < hi - 1:
                state[first_draft + row * drafts_per_seq + j - lo] = state[row]
    return o


def _verify_sequences(query_start: torch.Tensor, slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first row, end row, slot) of each sequence a verify op runs: those with a slot >= 0."""
    starts = query_start.tolist()
    return [(starts[b], starts[b + 1], row) for b, row in enumerate(slots.tolist()) if row >= 0]


def gated_delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor | None = None, *,
                               use_qk_l2norm: bool = False,
                               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token over one sequence (the definition).

    q, k: [T, Hk, K]; v: [T, Hv, V]; g (log-decay, <= 0), beta: [T, Hv];
    state: [Hv, K, V] or None (zeros). q, k are L2-normalized here if
    `use_qk_l2norm`, then q is multiplied by `scale` (default K^-0.5).
    Returns o: [T, Hv, V] in q's dtype and the final state [Hv, K, V] fp32;
    `state` itself is not modified.
    """
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare_delta_inputs(q, k, v, g, beta, use_qk_l2norm, scale)
    s = _initial_state(state, k, v)
    o = torch.empty_like(v)  # [T, Hv, V]
    for t in range(v.shape[0]):
        s, o[t] = _delta_step(s, q[t], k[t], v[t], g[t], beta[t])
    return o.to(out_dtype), s


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor | None = None, *,
                             use_qk_l2norm: bool = False, scale: float | None = None,
                             chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence in chunks (the prefill form); equals the recurrence.

    Same arguments and results as `gated_delta_rule_recurrent`. T is padded to a
    multiple of `chunk_size` with tokens that change nothing (g = 0, beta = 0, k = 0).

    Within a chunk of n tokens starting from state S0, with G_i = sum_{j<=i} g_j and
    D_ij = exp(G_i - G_j) for j <= i (0 above the diagonal), the writes U = [u_i]
    (S gains k_i u_i^T at step i) solve the unit lower-triangular system
        (I + tril(diag(beta) K K^T * D, -1)) U = diag(beta) V - diag(beta exp(G)) K S0
    (the WY / UT transform), and then
        O     = (Q * exp(G)) S0 + ((Q K^T) * D) U
        S_end = exp(G_n) S0 + (K * exp(G_n - G))^T U.
    """
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare_delta_inputs(q, k, v, g, beta, use_qk_l2norm, scale)
    t_len, hv, dv = v.shape
    s = _initial_state(state, k, v)
    if t_len == 0:
        return v.to(out_dtype), s
    pad = (-t_len) % chunk_size
    n = chunk_size
    # [T, H, D] -> [H, chunks, n, D]; [T, H] -> [H, chunks, n]
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).reshape(-1, n, hv, x.shape[-1]).permute(2, 0, 1, 3) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)).reshape(-1, n, hv).permute(2, 0, 1) for x in (g, beta))

    G = g.cumsum(-1)  # [H, N, n]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    # D[..., i, j] = exp(G_i - G_j) on and below the diagonal; masked before exp so it cannot overflow
    D = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, N, n, n]
    k_beta = k * beta[..., None]
    L = (k_beta @ k.transpose(-1, -2) * D).tril(-1) + torch.eye(n, device=q.device)
    rhs = torch.cat([v * beta[..., None], k_beta * G.exp()[..., None]], dim=-1)  # [H, N, n, V+K]
    w = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
    u_free, w_state = w[..., :dv], w[..., dv:]  # U = u_free - w_state @ S0
    attn = q @ k.transpose(-1, -2) * D  # [H, N, n, n]
    q_decayed = q * G.exp()[..., None]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]
    chunk_decay = G[..., -1].exp()[..., None, None]  # [H, N, 1, 1]

    o = torch.empty_like(v)
    for c in range(o.shape[1]):
        u = u_free[:, c] - w_state[:, c] @ s  # [H, n, V]
        o[:, c] = q_decayed[:, c] @ s + attn[:, c] @ u
        s = s * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ u
    o = o.permute(1, 2, 0, 3).reshape(-1, hv, dv)[:t_len]  # [H, N, n, V] -> [T, Hv, V]
    return o.to(out_dtype), s


def gated_delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor | None = None, *,
                            use_qk_l2norm: bool = False, scale: float | None = None) -> torch.Tensor:
    """One decode token for each of B sequences; their recurrent states are updated in place.

    q, k: [B, Hk, K]; v: [B, Hv, V]; g, beta: [B, Hv]. Without `slots`, state is
    [B, Hv, K, V]. With `slots` [B] (int), state is a pool [N, Hv, K, V] and
    sequence b owns state[slots[b]]; slots must be distinct, and a slot < 0 marks a
    padding row (zero output, no state touched). Returns o: [B, Hv, V] in q's dtype.
    """
    batch, rows = _live_rows(slots, q.shape[0], q.device)
    qf, kf, vf, gf, bf = _prepare_delta_inputs(q[batch], k[batch], v[batch], g[batch], beta[batch],
                                               use_qk_l2norm, scale)
    s, o_live = _delta_step(state[rows].float(), qf, kf, vf, gf, bf)
    state[rows] = s.to(state.dtype)
    o = q.new_zeros(v.shape)
    o[batch] = o_live.to(q.dtype)
    return o


def _live_rows(slots: torch.Tensor | None, b: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch rows that are real sequences [B'], the state rows they own [B'])."""
    rows = torch.arange(b, device=device)
    if slots is None:
        return rows, rows
    slots = slots.long()
    live = slots >= 0
    return rows[live], slots[live]


def _prepare_delta_inputs(q, k, v, g, beta, use_qk_l2norm: bool, scale: float | None):
    """fp32 q, k expanded to the value heads, normalized and scaled as transformers does."""
    hk, hv = k.shape[-2], v.shape[-2]
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    q, k = (x.float().repeat_interleave(hv // hk, dim=-2) for x in (q, k))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    return q, k, v.float(), g.float(), beta.float()


def _initial_state(state: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[Hv, K, V] fp32: a copy of `state`, or zeros for a fresh sequence."""
    if state is None:
        return torch.zeros(v.shape[-2], k.shape[-1], v.shape[-1], dtype=torch.float32, device=v.device)
    return state.float().clone()


def _delta_step(s, q, k, v, g, beta):
    """One token of the rule for any leading dims. s: [..., K, V]; q, k: [..., K]; v: [..., V]; g, beta: [...]."""
    s = s * g.exp()[..., None, None]
    delta = beta[..., None] * (v - torch.einsum("...kv,...k->...v", s, k))
    s = s + k[..., :, None] * delta[..., None, :]
    return s, torch.einsum("...kv,...k->...v", s, q)
