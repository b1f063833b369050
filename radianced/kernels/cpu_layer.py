"""A dense decoder layer of a decode step (Llama's, SmolLM2's) on the host backend in one C call (cpu_layer.c).

Why: op by op, a SmolLM2 layer is ~25 calls from Python (two RMSNorms of seven torch ops, five products, the
attention, views, residual adds), each a few microseconds of dispatch, allocation or ctypes around kernels of
10-100 us; on the 2-core Zen 4 EPYC a decode step spent 3.4 ms of 10.7 at batch 1, and 6 of 24 at batch 8, outside
the C kernels. Here the layer is one call: the same products in the same order (cpu_layer.c), its scratch made
once a step. Values: the products and the attention are the op-by-op path's; the RMSNorms are within a few units
of fp32 rounding of the reference's (their sums of squares in another order); so is the silu where AMX takes the
MLP's format (cpu_exp.h's there, torch's on the op path; elsewhere both are the fused SwiGLU's).

Over quantized planes (`--kv-cache-dtype fp8 | fp8_v4 | k6_v4`) the attention is cpu_attention.c's over the planes
(`DenseLayer.planes`): the op path's rotation, store and attention of those planes, in the same call.

`DenseLayer` holds one layer's arguments (the weights' pointers and shapes, checked once); `Scratch` a decode
step's (where its context lies and its new tokens go, the rotation's tables, buffers for its rows), made on the
step's first layer.
"""

from __future__ import annotations

import ctypes

import torch

from radianced.kernels import cpu_blocks
from radianced.kernels.cpu_attention import G_MAX, Context, PlanePair, PlaneReads, PlaneSlots

_i64 = ctypes.c_int64


class _Layer(ctypes.Structure):  # cpu_layer.c `rad_dense_layer`
    _fields_ = [("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                *((name, ctypes.c_void_p) for name in ("wqkv", "wo", "wg", "wu", "wd")),
                *((name, _i64) for name in ("qkv_bytes", "o_bytes", "gu_bytes", "d_bytes", "qkv_fmt", "o_fmt",
                                            "gu_fmt", "d_fmt", "hidden", "inter", "hq", "hkv", "d")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class _Step(ctypes.Structure):  # cpu_layer.c `rad_decode_step`
    _fields_ = [("block_rows", ctypes.c_void_p), ("lens", ctypes.c_void_p), ("write_rows", ctypes.c_void_p),
                ("nb", _i64), ("bs", _i64), ("r", _i64), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                *((name, ctypes.c_void_p) for name in ("h", "qkv", "att", "q_rot", "g", "u", "t", "k_rot"))]


def _declare() -> ctypes.CDLL | None:
    lib = cpu_blocks._lib() if cpu_blocks.available() else None
    if lib is None or not hasattr(lib, "rad_dense_layer_decode"):
        return None
    fn, planes = lib.rad_dense_layer_decode, lib.rad_dense_layer_decode_planes
    if fn.argtypes is None:
        fn.argtypes = [ctypes.POINTER(_Layer), ctypes.POINTER(_Step), ctypes.c_void_p, _i64, ctypes.c_void_p,
                       ctypes.c_void_p, _i64, ctypes.c_int]
        planes.argtypes = [ctypes.POINTER(_Layer), ctypes.POINTER(_Step), ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_void_p, _i64, ctypes.c_int]
        fn.restype = planes.restype = None
    return lib


class Scratch:
    """A decode step's arguments for every layer: where its context lies and its new tokens go (a plain cache's
    `Context`: the rows each sequence reads and writes; or quantized planes' `PlaneReads` and `PlaneSlots`: block
    ids and slots), the rotation's cos and signed sin ([T, 1, R] fp32), and buffers for T rows of a model's widths."""

    __slots__ = ("dims", "cache", "keep", "args", "ptr")

    def __init__(self, cache: Context | tuple[PlaneReads, PlaneSlots], cos: torch.Tensor, sin: torch.Tensor,
                 dims: tuple[int, int, int, int, int]):
        hidden, nqkv, qd, inter, d = dims
        if isinstance(cache, Context):
            where = (cache.block_rows, cache.lens, cache.write_rows, cache.block_size)
        else:
            reads, slots = cache
            where = (reads.ids, reads.lens, slots.slots, reads.block_size)
        t, r = len(where[1]), cos.shape[-1]
        if len(where[2]) != t:
            raise ValueError(f"the step writes {len(where[2])} rows and reads {t} sequences' contexts")
        if cos.dtype is not torch.float32 or sin.dtype is not torch.float32 or not cos.is_contiguous() \
                or not sin.is_contiguous() or cos.numel() != t * r or sin.numel() != t * r or r % 2 or r > d:
            raise ValueError(f"cos and sin must be contiguous fp32 [{t}, 1, R], R even and at most {d}, got "
                             f"{list(cos.shape)} and {list(sin.shape)}")
        kv = (nqkv - qd) // 2
        bufs = [torch.empty(t, w, dtype=torch.float32) for w in (hidden, nqkv, qd, qd, inter, inter, hidden, kv)]
        self.dims, self.cache, self.keep = dims, cache, (where, cos, sin, bufs)
        self.args = _Step(where[0].data_ptr(), where[1].data_ptr(), where[2].data_ptr(), where[0].shape[1], where[3],
                          r, cos.data_ptr(), sin.data_ptr(), *(b.data_ptr() for b in bufs))
        self.ptr = ctypes.pointer(self.args)


class DenseLayer:
    """One Llama layer's arguments for cpu_layer.c: its norms (fp32 [hidden]), its five GGUF-format matrices
    (`cpu_blocks.Matrix`: [q | k | v], o, gate, up, down) and its attention's shape; `rows`: the most rows of x it
    takes (None: any). `make` returns None where the layer is not one cpu_layer.c runs (other formats, gate and up
    apart, a GQA ratio past G_MAX, no library)."""

    __slots__ = ("lib", "keep", "dims", "hkv_d", "rows", "args", "ptr")

    def __init__(self, lib: ctypes.CDLL, norms: tuple[torch.Tensor, torch.Tensor], eps: float, mats: tuple,
                 heads: tuple[int, int, int], scale: float):
        (hq, hkv, d), (qkv, o, gate, up, down) = heads, mats
        hidden, inter = o.shape[0], gate.shape[0]
        self.lib, self.keep, self.hkv_d = lib, (norms, mats), hkv * d
        self.dims = (hidden, qkv.shape[0], hq * d, inter, d)
        # rows of x the op path takes through the block products too (past a matrix's gemm_rows it dequantizes
        # and runs torch's GEMM: other sums), so the most this call takes
        self.rows = min((m.gemm_rows for m in mats if m.gemm_rows is not None), default=None)
        self.args = _Layer(norms[0].data_ptr(), norms[1].data_ptr(), *(m._w[0] for m in mats[:4]), down._w[0],
                           qkv._w[1], o._w[1], gate._w[1], down._w[1], qkv._w[2], o._w[2], gate._w[2], down._w[2],
                           hidden, inter, hq, hkv, d, eps, scale)
        self.ptr = ctypes.pointer(self.args)

    @staticmethod
    def make(norms: tuple[torch.Tensor, torch.Tensor], eps: float, mats: tuple, heads: tuple[int, int, int],
             scale: float) -> DenseLayer | None:
        """norms: (input, post-attention) RMSNorm weights; mats: the `Matrix`es of [q | k | v], o, gate, up, down
        (None where a weight is not one); heads: (query heads, KV heads, head dim)."""
        lib = _declare()
        (hq, hkv, d), (qkv, o, gate, up, down) = heads, mats
        if lib is None or any(m is None for m in mats) or hkv == 0 or hq % hkv or hq // hkv > G_MAX:
            return None
        hidden, inter = o.shape[0], gate.shape[0]
        fits = (qkv.shape == (hq * d + 2 * hkv * d, hidden) and o.shape == (hidden, hq * d)
                and gate.shape == up.shape == (inter, hidden) and gate._w[1:] == up._w[1:]
                and down.shape == (hidden, inter))
        if not fits or any(n.dtype != torch.float32 or n.shape != (hidden,) or not n.is_contiguous() for n in norms):
            return None
        return DenseLayer(lib, norms, eps, mats, heads, scale)

    def scratch(self, cache: Context | tuple[PlaneReads, PlaneSlots], cos: torch.Tensor, sin: torch.Tensor,
                held: Scratch | None) -> Scratch:
        """`held` where it was made for this model's widths, else a new `Scratch` for this step."""
        return held if held is not None and held.dims == self.dims else Scratch(cache, cos, sin, self.dims)

    def __call__(self, x: torch.Tensor, scratch: Scratch, flat: torch.Tensor, v_rows: int) -> torch.Tensor:
        """x [T, hidden] contiguous fp32 -> the layer's output [T, hidden]; flat: the cache pair's rows
        ([R, Hkv * D] fp32, K from row 0, V `v_rows` further: kernels/cpu.py `_Rows`); scratch: a plain cache's."""
        context = scratch.cache
        if not isinstance(context, Context):
            raise ValueError("this step's scratch addresses quantized planes, not a plain cache's rows")
        self._check(x, scratch)
        context.check_rows(flat, v_rows, self.hkv_d)
        y = torch.empty_like(x)
        self.lib.rad_dense_layer_decode(self.ptr, scratch.ptr, flat.data_ptr(), v_rows, x.data_ptr(), y.data_ptr(),
                                        len(x), torch.get_num_threads())
        return y

    def planes(self, x: torch.Tensor, scratch: Scratch, pair: PlanePair) -> torch.Tensor:
        """The layer over quantized planes (`PlanePair`; scratch made for them): x [T, hidden] contiguous fp32 -> its
        output [T, hidden], the new K and V rows stored into the planes."""
        if isinstance(scratch.cache, Context):
            raise ValueError("this step's scratch addresses a plain cache's rows, not quantized planes")
        reads, slots = scratch.cache
        if pair.shape[3] * pair.shape[4] != self.hkv_d or pair.shape[4] != self.dims[4]:
            raise ValueError(f"the planes hold {pair.shape[3]} heads of {pair.shape[4]}; the layer's KV is "
                             f"{self.hkv_d // self.dims[4]} heads of {self.dims[4]}")
        self._check(x, scratch)
        pair.check(reads, slots, len(x))
        y = torch.empty_like(x)
        self.lib.rad_dense_layer_decode_planes(self.ptr, scratch.ptr, pair.ptr, x.data_ptr(), y.data_ptr(), len(x),
                                               torch.get_num_threads())
        return y

    def _check(self, x: torch.Tensor, scratch: Scratch) -> None:
        t = len(scratch.keep[0][1])
        if x.shape != (t, self.dims[0]) or not x.is_contiguous() or x.dtype is not torch.float32 \
                or scratch.dims != self.dims:
            raise ValueError(f"x must be contiguous fp32 [{t}, {self.dims[0]}], got {list(x.shape)}")
