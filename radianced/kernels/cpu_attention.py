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

`PlanePair.decode` is the same attention over the quantized planes of `--kv-cache-dtype fp8 | fp8_v4 | k6_v4`
(kernels/kv_formats.py: K fp8 or int6 as the residual from its block's first token, V fp8, or int4 in the DCT
basis), read as their codes: each chunk of keys dequantized into buffers as `KVPlane.blocks` dequantizes them (the
same values bit for bit), then the same scores, softmax and sums; a rotated V's sums are made in its basis and
brought back once (attention is linear in V; `KVPlane.blocks` rotates every token: other roundings, within fp32's).
Before it the host backend gathered and dequantized every sequence's whole context in each layer and ran SDPA over
it. `PlanePair.store` writes the planes in a call each (`KVPlane.store`'s bytes; a rotated V's rotation is a sum in
order where the reference's is a torch matmul, so a code sitting on a rounding boundary may go one step either
way). A pair's pointers are kept, and a step's block table and slots are checked once for all of its layers
(`PlaneReads`, `PlaneSlots`; kernels/cpu.py). A Llama decode layer over the planes runs in one C call too
(kernels/cpu_layer.py: `rad_decode_attention_planes_rotary`, the rotation, store and attention here).

SmolLM2 decode steps, 2 threads, a Zen 4 EPYC. fp8, before -> with the read -> with the write too -> the checks
once a step -> the fused layer (the plain fp32 cache beside): b8 at contexts of 1,000 374 -> 61 -> 58 -> 53-56 ->
41 ms (48), b8 at 100 72 -> 34 -> 29 -> 23-26 -> 18.5-21.6 (19.4), b1 at 1,000 65 -> 28 -> 20 -> 16-19 -> 11.2
(12.1). fp8_v4 and k6_v4 before (the gather, `KVPlane.blocks`, SDPA) -> in place (the int codes 8 dims at a time
with AVX2): b8 at 1,000 373 -> 41.5 and 410 -> 45 ms, b1 at 1,000 98 -> 12.7 and 82 -> 13.1.
"""

from __future__ import annotations

import ctypes

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
        read = _entries_read(self.block_rows, self.lens, block_size, "row")
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


def _entries_read(table: torch.Tensor, lens: torch.Tensor, block_size: int, unit: str) -> torch.Tensor:
    """The entries of a block table [B, nb] that contexts of `lens` [B] tokens read (their first blocks), refusing
    a negative one (ValueError: before the cache's first `unit`)."""
    read = table[torch.arange(table.shape[1]) < (lens[:, None] + block_size - 1) // block_size]
    if len(read) and int(read.min()) < 0:
        raise ValueError(f"a block read lies before the cache's first {unit}")
    return read


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, H, D] as the kernel reads it: heads D apart, unit stride (its rows any distance apart)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


D_MAX = 256  # head dims the quantized planes' kernels hold a chunk of (cpu_attention.c)


# a plane's format -> cpu_attention.c's PLANE_* kind
PLANE_KINDS = {"fp8": 0, "int6": 1, "int4": 2}


class PlanePair:
    """A layer's quantized KV planes (`--kv-cache-dtype fp8 | fp8_v4 | k6_v4`: kernels/kv_quant.py `KVPlane`s, K a
    delta plane in fp8 or int6, V a plain fp8 one or an int4 one in the DCT basis) as the kernels address them,
    checked once (kernels/cpu.py keeps one per pair of planes): `ptr`, cpu_kernels.h's `rad_kv_planes` (each plane's
    codes' and scales' pointers and strides, their kinds, V's basis). `of` gives None where the kernels do not apply
    (other formats, D past D_MAX, other layouts, the library not built): the caller runs the general path. Like
    `Context` it holds the tensors it points at (the planes' own, not the planes: kernels/cpu.py keys it on them, and
    the strides it made), so the pointers stay valid while it lives."""

    __slots__ = ("tensors", "shape", "ptr")

    def __init__(self, k_plane, v_plane):
        basis = v_plane.basis
        held = [t for plane in (k_plane, v_plane) for t in (plane.codes, _strides(plane.codes), plane.scales,
                                                            _strides(plane.scales))]
        self.tensors = (*held, basis)
        self.shape = (*k_plane.codes.shape[:4], k_plane.head_dim)  # [P, N, S, Hkv, D]
        self.ptr = ctypes.pointer(_KvPlanes(*(t.data_ptr() for t in held), self.shape[1],
                                            PLANE_KINDS[k_plane.fmt.name], PLANE_KINDS[v_plane.fmt.name],
                                            None if basis is None else basis.data_ptr()))

    @staticmethod
    def of(k_plane, v_plane) -> PlanePair | None:
        kf, vf = k_plane.fmt, v_plane.fmt
        if not (kf.delta and not kf.rotated and kf.name in ("fp8", "int6") and not vf.delta
                and vf.rotated == (vf.name == "int4") and vf.name in ("fp8", "int4") and available()):
            return None
        d = k_plane.head_dim
        p, n, s, hkv = k_plane.codes.shape[:4]
        if v_plane.head_dim != d or d > D_MAX or vf.rotated and (
                v_plane.basis.dtype is not torch.float32 or v_plane.basis.shape != (d, d)
                or not v_plane.basis.is_contiguous() or not v_plane.basis.is_cpu):
            return None
        for plane, fmt in ((k_plane, kf), (v_plane, vf)):
            pairs = fmt.scale_shape(s, hkv, d)[2:]  # fp8: (1,); int: (groups, 2), the pairs contiguous
            if plane.codes.shape != (p, n, s, hkv, fmt.code_bytes(d)) or plane.codes.stride(4) != 1 \
                    or not plane.codes.is_cpu or plane.scales.dtype is not torch.float16 \
                    or plane.scales.shape != (p, n, s, hkv, *pairs) or not plane.scales.is_cpu \
                    or len(pairs) == 2 and plane.scales.stride()[4:] != (2, 1):
                return None
        return PlanePair(k_plane, v_plane)

    def decode(self, q: torch.Tensor, reads: PlaneReads, scale: float) -> torch.Tensor | None:
        """A decode step's attention over the planes read in place: q [B, Hq, D] fp32, one query a sequence,
        `reads` the step's -> out [B, Hq, D] fp32, the reference attention's values within fp32 rounding (a
        rotated V's sums made in its basis and brought back once). None where q does not fit the kernel (not CPU
        fp32, more than G_MAX query heads a KV head)."""
        s, hkv, d = self.shape[2:]
        b, hq = q.shape[:2]
        if q.dtype is not torch.float32 or not q.is_cpu or q.shape[2] != d or hq % hkv or hq // hkv > G_MAX:
            return None
        self.check(reads, None, b)
        q = q.contiguous()
        out = torch.empty(b, hq, d, dtype=torch.float32)
        if b:
            cpu_blocks._lib().rad_decode_attention_planes(
                q.data_ptr(), self.ptr, reads.ids.data_ptr(), reads.ids.shape[1], reads.lens.data_ptr(), s, b, hq, hkv,
                d, scale, out.data_ptr(), torch.get_num_threads())
        return out

    def check(self, reads: PlaneReads | None, slots: PlaneSlots | None, b: int) -> None:
        """Raise ValueError unless a step's reads (of `b` sequences) and slots lie inside the planes."""
        p, n, s = self.shape[:3]
        if reads is not None:
            if reads.b != b or reads.block_size != s:
                raise ValueError(f"the step's reads are of {reads.b} sequences in blocks of {reads.block_size} "
                                 f"tokens; q has {b} and the cache blocks of {s}")
            if reads.top > p * n:
                raise ValueError(f"a block read lies outside the cache's {p * n} blocks")
        if slots is not None and slots.top > p * n * s:
            raise ValueError(f"slots must be in 0..{p * n * s - 1}, got {slots.slots.tolist()}")

    def store(self, slots: PlaneSlots, k: torch.Tensor, v: torch.Tensor) -> bool:
        """`store(slots, k)` and `store(slots, v)` of the K and V planes (`KVPlane.store`'s bytes bit for bit, a
        rotated V's up to its rotation's last bit: cpu_attention.c `rad_store_planes`), the rows without a slot left
        out: k, v [T, Hkv, D] fp32, `slots` the step's. False, nothing written, where they are not CPU fp32 (the
        caller stores through `KVPlane.store`: in torch ~10 ms of SmolLM2's b8 decode step at contexts of 1,000
        in fp8: its quantize, the delta's read of each block's token 0, the index writes)."""
        s, hkv, d = self.shape[2:]
        t = len(slots.slots)
        for x in (k, v):
            if x.dtype is not torch.float32 or not x.is_cpu or x.shape != (t, hkv, d):
                return False
        self.check(None, slots, 0)
        if t:
            k, v = _rows(k), _rows(v)
            cpu_blocks._lib().rad_store_planes(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                                               slots.slots.data_ptr(), t, self.ptr, s, hkv, d, torch.get_num_threads())
        return True


class PlaneReads:
    """A decode step's block table and context lengths as `PlanePair.decode` reads them, checked once a step
    (kernels/cpu.py `_per_step`): ids [B, nb] int64 flat block ids, lens [B]; top: one past the highest block
    read (checked against each pair's blocks)."""

    __slots__ = ("ids", "lens", "b", "block_size", "top")

    def __init__(self, block_tables: torch.Tensor, seq_lens, b: int, block_size: int):
        self.lens = torch.as_tensor(seq_lens, dtype=torch.int64).contiguous()
        self.ids = block_tables[:b].to(torch.int64).contiguous()
        self.b, self.block_size = b, block_size
        nb, s = self.ids.shape[1], block_size
        if self.ids.shape[0] != b or self.lens.shape != (b,) or bool((self.lens < 0).any()) \
                or bool((self.lens > nb * s).any()):
            raise ValueError(f"block_tables must have {b} rows and seq_lens be [{b}] in 0..{nb * s} (the table's "
                             f"tokens), got {self.ids.shape[0]} rows and {self.lens.tolist()}")
        read = _entries_read(self.ids, self.lens, s, "block")
        self.top = int(read.max()) + 1 if len(read) else 0


class PlaneSlots:
    """A step's KV slots as `PlanePair.store` writes them, checked once a step (kernels/cpu.py `_per_step`):
    slots [T] int64 (negative: a row without a slot, not written; the others distinct); top: one past the highest
    slot."""

    __slots__ = ("slots", "top")

    def __init__(self, slot_mapping: torch.Tensor):
        self.slots = slot_mapping.to(torch.int64).contiguous()
        written = self.slots[self.slots >= 0]
        if len(written.unique()) != len(written):
            raise ValueError(f"slots must be distinct, got {slot_mapping.tolist()}")
        self.top = int(written.max()) + 1 if len(written) else 0


class _KvPlanes(ctypes.Structure):  # cpu_kernels.h `rad_kv_planes`
    _fields_ = [*((name, ctypes.c_void_p) for name in ("k_codes", "kcs", "k_scales", "kss", "v_codes", "vcs",
                                                       "v_scales", "vss")),
                *((name, ctypes.c_int64) for name in ("per_page", "k_kind", "v_kind")), ("basis", ctypes.c_void_p)]


def _strides(x: torch.Tensor) -> torch.Tensor:
    """A plane view's [page, block, token, head] strides (its elements), as the kernel addresses it."""
    return torch.tensor(x.stride()[:4], dtype=torch.int64)
