"""One decode step's attention read in place from the host backend's paged KV cache (cpu_attention.c, built
into the block kernels' library by cpu_blocks.py).

Why: kernels/cpu.py's decode gathered every sequence's whole context out of the cache pair's rows in each
layer (one index_select: B x C x Hkv x D x 2 floats) and ran torch's SDPA over it, the contexts padded to the
longest under an additive mask. The C kernel reads each key and value row where it lies, only the sequence's
own keys, an online softmax in fp32 over (sequence, KV head) pairs on OpenMP threads.

Values: each score is q . k (8 lane sums, then added across lanes) times the scale, then e^(score - running
max) (within 1 unit of fp32 rounding: cpu_exp.h `rad_expf`), the V rows summed with those weights and
divided by their sum once: the reference's products, summed in another order and rescaled per chunk of keys, so
the output differs from `reference.paged_attention` by fp32 rounding (up to 9.9e-7 of max |ref| over 213 keys,
SDPA's up to 7.1e-7 on the same cases; tests/kernels/test_cpu_attention.py holds it to 4e-6). The sums do not
depend on the thread count: one thread computes a (sequence, KV head) pair whole.

`Context.rotary` does a decode layer's prologue in the same call: RoPE on q and k and the new token's K and V
rows written (kernels/cpu.py `_rotate` and `_write`'s values bit for bit), then the attention.

`decode_fp8` is the same attention over `--kv-cache-dtype fp8`'s planes (kernels/kv_formats.py), read as their
codes: each chunk of keys dequantized into buffers as `KVPlane.blocks` dequantizes them (the same values bit for
bit), then the same scores, softmax and sums. Before it the host backend gathered and dequantized every
sequence's whole context in each layer and ran SDPA over it. `store_fp8` writes the planes in one call
(`KVPlane.store`'s bytes). SmolLM2 decode steps, 2 threads, a Zen 4 EPYC, before -> with the read -> with the
write too (the plain fp32 cache beside): b8 at contexts of 1,000 374 -> 61 -> 58 ms (50), b8 at 100 72 -> 34 -> 29
(20), b1 at 1,000 65 -> 28 -> 20 (13). What is left against the plain cache is the layer's ops, which the fused
layer (kernels/cpu_layer.py) takes only over a plain cache.
"""

from __future__ import annotations

import torch

from radianced.kernels import cpu_blocks

G_MAX = 16  # query heads a KV head the kernel holds (cpu_attention.c)


def available() -> bool:
    """Whether the kernel is built (or can be): the block kernels' library."""
    return cpu_blocks.available()


class Context:
    """The keys a decode step's sequences read and the rows its new tokens write, checked once a step, the
    kernel's per-step arguments kept: `Context(block_rows, lens, block_size, write_rows).rotary(...)` is a
    decode layer's rotation, K/V write and each sequence's attention over its context. block_rows [B, nb] int:
    the row (of `flat`) of each block-table entry's token 0; lens [B]: the context lengths (sequence b reads
    its tokens 0 .. lens[b] - 1 at rows block_rows[b, c // S] + c % S); write_rows [B] int: the K row each
    sequence's new token goes to, -1 for none (a padding row). Like `cpu_blocks.Matrix` it holds its tensors,
    so the pointers it keeps stay valid while it lives."""

    __slots__ = ("block_rows", "lens", "write_rows", "block_size", "_args", "_top", "_run")

    def __init__(self, block_rows: torch.Tensor, lens: torch.Tensor, block_size: int, write_rows: torch.Tensor):
        self.block_rows = block_rows.to(torch.int64).contiguous()
        self.lens, self.block_size = lens.to(torch.int64).contiguous(), block_size
        b, nb = self.block_rows.shape
        if self.lens.shape != (b,) or bool((self.lens < 0).any()) or bool((self.lens > nb * block_size).any()):
            raise ValueError(f"lens must be [{b}] in 0..{nb * block_size} (the block table's tokens), got "
                             f"{self.lens.tolist()}")
        used = torch.arange(nb) < (self.lens[:, None] + block_size - 1) // block_size  # the blocks read
        read = self.block_rows[used]
        if len(read) and int(read.min()) < 0:
            raise ValueError("a block read lies before the cache's first row")
        self._top = int(read.max()) + block_size if len(read) else 0  # rows below this one are read (K)
        self.write_rows = write_rows.to(torch.int64).contiguous()
        if self.write_rows.shape != (b,) or bool((self.write_rows < -1).any()):
            raise ValueError(f"write_rows must be [{b}] rows (-1: none), got {self.write_rows.tolist()}")
        self._top = max(self._top, int(self.write_rows.max()) + 1 if b else 0)  # and written (K and V)
        self._args = (self.block_rows.data_ptr(), nb, self.lens.data_ptr(), block_size, b)
        self._run = cpu_blocks._lib().rad_decode_attention

    def _check(self, q: torch.Tensor, flat: torch.Tensor, v_rows: int) -> tuple[int, int, int, int]:
        """(B, Hq, Hkv, D), once q and the cache rows are checked to fit the step."""
        b, hq, d = q.shape
        hkv = flat.shape[1] // d
        if q.dtype is not torch.float32 or not q.is_cpu:
            raise ValueError(f"q and the cache rows must be CPU fp32, got {q.dtype} and {flat.dtype}")
        if b != self._args[4] or hkv * d != flat.shape[1] or hq % hkv or hq // hkv > G_MAX:
            raise ValueError(f"q {list(q.shape)} and cache rows {list(flat.shape)} do not fit {self._args[4]} "
                             f"sequences, Hq a multiple of Hkv (at most {G_MAX}x)")
        self.check_rows(flat, v_rows, hkv * d)
        return b, hq, hkv, d

    def check_rows(self, flat: torch.Tensor, v_rows: int, row: int) -> None:
        """Raise ValueError unless `flat` is a cache pair's rows as the kernel reads them (CPU fp32 [R, row], rows
        packed) and holds every row this step reads and writes, V `v_rows` past K."""
        if flat.dtype is not torch.float32 or not flat.is_cpu:
            raise ValueError(f"q and the cache rows must be CPU fp32, got cache rows of {flat.dtype}")
        if flat.dim() != 2 or flat.shape[1] != row or flat.stride() != (row, 1):
            raise ValueError(f"cache rows {list(flat.shape)} (strides {flat.stride()}) do not fit rows of {row} "
                             f"values")
        if v_rows < 0 or self._top + v_rows > flat.shape[0]:
            raise ValueError(f"the keys read reach row {self._top + v_rows} of {flat.shape[0]}")

    def rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               flat: torch.Tensor, v_rows: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode layer's rotation, K/V write and attention in one call: q [B, Hq, D] and k [B, Hkv, D]
        rotated by cos and signed sin ([B, 1, R] or [B, R], kernels/cpu.py `_rope_tables`': the dims past R
        pass), the rotated k and v [B, Hkv, D] written to each sequence's `write_rows` (K) and V rows, then the
        rotated q's attention over each context (q's rows any distance apart; flat [R, Hkv * D] fp32 rows, the
        cache pair: K from row 0, V `v_rows` further) -> (out [B, Hq, D], the rotated q [B, Hq, D]). The rotation
        is kernels/cpu.py `_rotate`'s bit for bit (the same products and sums); the K and V rows it writes too."""
        b, hq, hkv, d = self._check(q, flat, v_rows)
        r = cos.shape[-1]
        if k.shape != (b, hkv, d) or v.shape != (b, hkv, d) or k.dtype is not torch.float32 \
                or v.dtype is not torch.float32 or not k.is_cpu or not v.is_cpu or r % 2 or r > d \
                or cos.dtype is not torch.float32 or sin.dtype is not torch.float32 or cos.numel() != b * r \
                or sin.numel() != b * r or not cos.is_contiguous() or not sin.is_contiguous():
            raise ValueError(f"k {list(k.shape)} and v {list(v.shape)} must be [{b}, {hkv}, {d}] CPU fp32, cos and "
                             f"sin {list(cos.shape)} {list(sin.shape)} [{b}, R] contiguous fp32, R even, at most {d}")
        q, k, v = _rows(q), _rows(k), _rows(v)
        out = torch.empty(b, hq, d, dtype=torch.float32)
        q_rot = torch.empty(b, hq, d, dtype=torch.float32)
        if b:
            rows, nb, lens, s, _ = self._args
            self._run(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), cos.data_ptr(),
                      sin.data_ptr(), r, self.write_rows.data_ptr(), q_rot.data_ptr(), flat.data_ptr(), v_rows, rows,
                      nb, lens, s, b, hq, hkv, d, scale, out.data_ptr(), torch.get_num_threads())
        return out, q_rot


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, H, D] as the kernel reads it: heads D apart, unit stride (its rows any distance apart)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


D_MAX = 256  # head dims the fp8 kernel holds a chunk of (cpu_attention.c)


def decode_fp8(q: torch.Tensor, k_plane, v_plane, block_tables: torch.Tensor, seq_lens,
               scale: float) -> torch.Tensor | None:
    """A decode step's attention over fp8 KV planes (kernels/kv_quant.py `KVPlane`: K a delta plane, V plain) read
    in place: q [B, Hq, D] fp32, one query a sequence; block_tables [>= B, nb] flat block ids; seq_lens [B] the
    context lengths -> out [B, Hq, D] fp32, the reference attention's values within fp32 rounding. None where it
    does not apply (another format, not CPU fp32, D past D_MAX, more than G_MAX query heads a KV head, the
    library not built): the caller runs the general path."""
    kf, vf = k_plane.fmt, v_plane.fmt
    if not (kf.name == vf.name == "fp8" and kf.delta and not vf.delta and not vf.rotated and available()):
        return None
    b, hq, d = q.shape
    p, n, s, hkv, cb = k_plane.codes.shape
    if q.dtype is not torch.float32 or not q.is_cpu or d > D_MAX or cb != d or hq % hkv or hq // hkv > G_MAX \
            or v_plane.codes.shape != k_plane.codes.shape or not k_plane.codes.is_cpu:
        return None
    lens = torch.as_tensor(seq_lens, dtype=torch.int64).contiguous()
    ids = block_tables[:b].to(torch.int64).contiguous()
    nb = ids.shape[1]
    if ids.shape[0] != b or lens.shape != (b,) or bool((lens < 0).any()) or bool((lens > nb * s).any()):
        raise ValueError(f"block_tables must have {b} rows and seq_lens be [{b}] in 0..{nb * s} (the table's "
                         f"tokens), got {ids.shape[0]} rows and {lens.tolist()}")
    read = ids[torch.arange(nb) < (lens[:, None] + s - 1) // s]
    if len(read) and (int(read.min()) < 0 or int(read.max()) >= p * n):
        raise ValueError(f"a block read lies outside the cache's {p * n} blocks")
    planes = []
    for plane in (k_plane, v_plane):
        if plane.codes.stride(4) != 1 or plane.scales.dtype is not torch.float16 or not plane.scales.is_cpu \
                or plane.scales.shape != (p, n, s, hkv, 1) or not plane.codes.is_cpu:
            return None
        planes += [plane.codes.data_ptr(), _strides(plane.codes), plane.scales.data_ptr(), _strides(plane.scales)]
    q = q.contiguous()
    out = torch.empty(b, hq, d, dtype=torch.float32)
    if b:
        cpu_blocks._lib().rad_decode_attention_fp8(
            q.data_ptr(), planes[0], planes[1].data_ptr(), planes[2], planes[3].data_ptr(), planes[4],
            planes[5].data_ptr(), planes[6], planes[7].data_ptr(), n, ids.data_ptr(), nb, lens.data_ptr(), s, b, hq,
            hkv, d, scale, out.data_ptr(), torch.get_num_threads())
    return out


def store_fp8(plane, slots: torch.Tensor, x: torch.Tensor) -> bool:
    """`plane.store(slots, x)` for an fp8 plane (kernels/kv_quant.py `KVPlane`) in one C call, its bytes bit for bit
    (cpu_attention.c `rad_store_fp8`): x [T, Hkv, D] fp32, slots [T] flat, each >= 0 and distinct. False, nothing
    written, where it does not apply (another format, not CPU fp32, D past D_MAX, the library not built): the
    caller stores through `KVPlane.store` (in torch ~10 ms of SmolLM2's b8 decode step at contexts of 1,000: its
    quantize, the delta's read of each block's token 0, the index writes)."""
    if plane.fmt.name != "fp8" or plane.fmt.rotated or not available():
        return False
    p, n, s, hkv, d = plane.codes.shape
    if x.dtype is not torch.float32 or not x.is_cpu or x.shape != (len(slots), hkv, d) or d > D_MAX \
            or plane.codes.stride(4) != 1 or plane.scales.dtype is not torch.float16 \
            or plane.scales.shape != (p, n, s, hkv, 1) or not plane.codes.is_cpu or not plane.scales.is_cpu:
        return False
    slots = slots.to(torch.int64).contiguous()
    if len(slots) and (int(slots.min()) < 0 or int(slots.max()) >= p * n * s or len(slots.unique()) != len(slots)):
        raise ValueError(f"slots must be distinct and in 0..{p * n * s - 1}, got {slots.tolist()}")
    x = x.contiguous()
    cs, ss = _strides(plane.codes), _strides(plane.scales)
    if len(slots):
        cpu_blocks._lib().rad_store_fp8(x.data_ptr(), slots.data_ptr(), len(slots), plane.codes.data_ptr(),
                                        cs.data_ptr(), plane.scales.data_ptr(), ss.data_ptr(), n, s, hkv, d,
                                        int(plane.fmt.delta), torch.get_num_threads())
    return True


def _strides(x: torch.Tensor) -> torch.Tensor:
    """A plane view's [page, block, token, head] strides (its elements), as the kernel addresses it."""
    return torch.tensor(x.stride()[:4], dtype=torch.int64)
