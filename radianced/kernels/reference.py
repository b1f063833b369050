"""The fp32 torch truth for every op.

Each function here is the reference a Triton kernel in this package is tested
against, and the op the CPU backend runs. Shapes are in the docstrings; T is the
number of tokens in a step (all sequences flattened), B the number of sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


def rotary_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [T, rotary_dim] for integer positions [T] (HF's default rope, fp32)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions.device).float() / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, rotary_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first `cos.shape[-1]` dims of x: [T, H, D]; the rest passes."""
    rd = cos.shape[-1]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat((x_rot * c + rotated * s, x_pass), dim=-1)


# -- MLP --------------------------------------------------------------------


def silu_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """`down(silu(gate(x)) * up(x))`. x: [T, H]; gate, up: [I, H]; down: [H, I]."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


# -- paged KV ---------------------------------------------------------------
# A cache view for one layer is [P, N, S, Hkv, D]: P arena pages of N blocks of
# S tokens. Block id b lives at page b // N, position b % N inside the page.


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k, v: [T, Hkv, D] at flat slots [T] (slot = block * S + offset; < 0 = skip)."""
    _, n, s = k_cache.shape[:3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block, off = slots // s, slots % s
    k_cache[block // n, block % n, off] = k[keep]
    v_cache[block // n, block % n, off] = v[keep]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence: [length, Hkv, D], from its block table [nb]."""
    _, n, s = cache.shape[:3]
    blocks = block_table[: (length + s - 1) // s].long()
    return cache[blocks // n, blocks % n].flatten(0, 1)[:length]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start: list[int], seq_lens: list[int], scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged context.

    q: [T, Hq, D]; sequence b owns q rows query_start[b]:query_start[b+1], which are
    the last tokens of its seq_lens[b] context tokens (already written to the cache).
    block_tables: [B, max_blocks]. GQA: Hq is a multiple of Hkv. Returns [T, Hq, D].
    """
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


# -- routed experts ---------------------------------------------------------


def moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, table: torch.Tensor,
        slab: torch.Tensor, inter: int) -> torch.Tensor:
    """Routed SiLU experts, tokens grouped by expert.

    x: [T, H]; topk_ids, topk_weights: [T, k]; table: [E] slab row of each expert;
    slab: [R, 3 * I * H], a row = gate [I, H] | up [I, H] | down [H, I].
    Each distinct routed expert's row is read once (one index_select) and applied
    to all of its tokens; outputs are weighted and summed per token. Returns [T, H].
    """
    t, k = topk_ids.shape
    hidden = x.shape[1]
    experts, inverse = torch.unique(topk_ids.flatten(), return_inverse=True)  # sorted distinct experts
    rows = slab.index_select(0, table[experts])  # [n, 3IH]: one read per expert per step
    gate, up, down = rows.split(inter * hidden, dim=1)
    order = torch.argsort(inverse, stable=True)  # assignments grouped by expert
    token = order // k
    weight = topk_weights.flatten()[order]
    out = torch.zeros_like(x)
    start = 0
    for i, count in enumerate(torch.bincount(inverse, minlength=len(experts)).tolist()):
        idx = token[start:start + count]
        h = silu_mlp(x[idx], gate[i].view(inter, hidden), up[i].view(inter, hidden), down[i].view(hidden, inter))
        out.index_add_(0, idx, h * weight[start:start + count, None])
        start += count
    return out
