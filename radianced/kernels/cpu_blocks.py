"""GGUF matrices (Q4_0, Q4_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K of a Q4_K_M / Q5_K_M file) times
fp32 activations on the CPU, read from their blocks (cpu_blocks.c, built here once per machine with the
system's C compiler).

Why hand-written C: torch 2.13's weight-only low-bit matmuls (`aten._weight_int4pack_mm_for_cpu`,
`aten._weight_int8pack_mm`) are vectorized only for bf16 activations; with fp32 activations they are
scalar code, 5-100x slower than fp32 F.linear (measured on a 3072 x 576 matrix: 23.5 ms at M = 8
against 1.6 ms). Sessions 12-13 served compact weights through the int4 kernel in bf16: it rounds x
to 8 bits of mantissa, each group's fp16 scale to bf16 and its output to bf16, which moved SmolLM2's
logits by 1-3% of max |logit| and its greedy tokens against transformers' at near ties, so the default
model could not be served compact. This kernel dequantizes each weight in fp32 exactly as gguf's numpy
code does and multiplies in fp32: W's values are the reference's bit for bit and a product differs
from `F.linear(x, W.dequantize())` only in the order of its sums, like any fp32 GEMM. It reads the
`.rad`'s bytes in place (the int4 kernel needed a second packing in RAM).

On a CPU with AMX-BF16 (Sapphire Rapids on), from `amx_rows(fmt)` rows of x (Q4_0 / Q4_1 from 1, Q8_0 from
4), the product runs on the tile unit instead: gguf's w = d * q + m factored into d * sum(q x) + m * sum(x)
a chunk, the integer q exact in bf16 and x split exactly into three bf16 parts, so it is still within
fp32 rounding of the exact product, but W's dequantized values are no longer its operands (cpu_blocks.c's
header; `dequantize` stays bit for bit). On the 2-core Sapphire Rapids at M = 8: 2.2-2.5x faster on
SmolLM2's Q4_1 shapes with the weights from memory, 2.8-3.2x from L3, 1.45x on the Q8_0 lm_head; a batch-8
decode step 25-27 -> 17-19 ms, batch 1 14 -> 11 ms. A build without AMX (another CPU, or -mno-amx-tile) or
a kernel that refuses the tile state keeps the AVX2 tiles below; on a CPU with AVX-512 (Zen 4), Q4_0 / Q4_1 /
Q8_0 run the AVX-512 tiles instead: gguf's values in registers, 8 rows of x a tile; at M = 8 1.2-1.3x faster
than the AVX2 tiles on SmolLM2's shapes, 160-174 GFLOP/s on 2 Zen 4 cores (cpu_blocks.c's header).

Measured on this repository's 2-core AMD EPYC (AVX2 + FMA, no AVX-512), microseconds a call, each of
8 copies in turn (weights from memory, as a step reads its layers), against fp32 F.linear on the
dequantized matrix and the int4 kernel in bf16 (2 threads; the blocks' column before the two-row tiles
of issue 23, 1.3-1.6x faster since: cpu_blocks.c's header, tools/bench_cpu_blocks.py):

    shape (N x K)   fmt    M = 1: blocks  fp32  int4   M = 8: blocks  fp32  int4
    3072 x 576      q4_1          142     581   160           332     988   374
    3072 x 576      q8_0          124     541   290           320     924   772
    576 x 1536      q4_1           74     202    81           178     365   193
    49152 x 576     q8_0         1684    8948  4141          4969   18112 11881

The K-quants (no torch kernel reads them) were dequantized per use before, 25-35 ms for a 3072 x 512
matrix; through the blocks 0.47 ms (Q4_K), 0.76 (Q5_K), 0.72 (Q6_K) at M = 1 on one thread.

At a long prefill a GEMM library beats it (W's blocks are dequantized again for every few rows of x):
past `gemm_rows(fmt)` rows the matrix is dequantized by the same C code into a scratch and multiplied by
torch's fp32 GEMM, the values unchanged. Measured (2 threads, us a call, kernel / dequantize + GEMM), the
AVX2 tiles: 1536 x 576 q4_1 at M = 48: 689 / 1045, M = 64: 936 / 1121, M = 128: 1899 / 1665; 576 x 1536
q4_1 at M = 64: 1003 / 963; the q8_0 lm_head (49152 x 576) at M = 64: 29 / 93 ms: 64 rows. The AVX-512
tiles of Q4_0 / Q4_1 / Q8_0 (Zen 4) keep them to 192 rows, their AMX product to any (it beats GEMM to 512
rows on the Sapphire Rapids: 1536 x 576 q4_1 at M = 512 2.0 ms against 3.1, the q8_0 lm_head at M = 128
20 ms against 57); the K-quants' AMX product does not (Q6_K at M = 65: 2.8 ms against 2.2).

The library (this file's kernels, the decode attention's and the fused layer's: `SOURCES`) is compiled
with `-O3 -march=native -ffp-contract=off` (no fused multiply-add where gguf's dequantization rounds
twice) into radianced's cache folder, named by the sources' hash and the machine, atomically (`make
install` builds it; a missing one is built at first use, about a second).
Where no C compiler is found, `available` is False, one line on stderr says so, compact matrices
are dequantized per use as the reference ops do (correct, 5-70x slower) and decode attention stays torch's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from radianced.kernels.formats import CPU_BLOCKS, FORMATS as ALL_FORMATS

# the host backend's C kernels, one library: the block matmuls, the decode attention (cpu_attention.py) and
# a dense layer of a decode step made of them (cpu_layer.py)
SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_blocks.c", "cpu_attention.c", "cpu_layer.c"))
HEADERS = tuple(Path(__file__).with_name(n) for n in ("cpu_exp.h", "cpu_kernels.h"))  # in the build's key
FORMATS = {f: CPU_BLOCKS.index(f) for f in CPU_BLOCKS}  # cpu_blocks.c's format codes
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")


class BuildError(RuntimeError):
    """The C library could not be compiled or loaded; the message names the compiler's complaint."""


def library_path() -> Path:
    """Where this machine's build lives: radianced's cache folder, named by source, flags and machine."""
    from radianced.model.default import cache_dir

    key = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES + HEADERS) + " ".join(FLAGS).encode()
                         + platform.machine().encode() + platform.node().encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"cpu_blocks-{key}.so"


def build() -> Path:
    """Compile the C sources for this machine unless built already; returns the library's path.
    BuildError when no C compiler is found or it fails."""
    out = library_path()
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise BuildError("no C compiler (cc or gcc) on PATH to build the CPU block kernels; install gcc "
                         "(Debian: apt install gcc), or set CC")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    done = subprocess.run([cc, *FLAGS, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        raise BuildError(f"{cc} failed on {', '.join(s.name for s in SOURCES)}: {done.stderr.strip()[-2000:]}")
    os.replace(tmp, out)  # atomic: a concurrent build leaves one whole file
    return out


@functools.cache
def _lib() -> ctypes.CDLL | None:
    """The loaded library (built if missing), or None where it cannot be built (`available`)."""
    try:
        lib = ctypes.CDLL(str(build()))  # CDLL releases the GIL during each call
    except (BuildError, OSError) as e:
        print(f"radianced: CPU block kernels unavailable ({e}); compact weights are dequantized per use "
              "(5-70x slower)", file=sys.stderr)
        return None
    return declare(lib)


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` (a build of `SOURCES`) with its functions' C signatures set."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.rad_blocks_matmul.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, ctypes.c_int, ptr, i64, ctypes.c_int]
    lib.rad_blocks_dequantize.argtypes = [ptr, i64, i64, i64, ctypes.c_int, ptr, ctypes.c_int]
    lib.rad_decode_attention.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, i64,
                                         ptr, i64, i64, i64, i64, i64, ctypes.c_float, ptr, ctypes.c_int]
    lib.rad_blocks_matmul.restype = lib.rad_blocks_dequantize.restype = lib.rad_decode_attention.restype = None
    lib.rad_decode_attention_planes.argtypes = [ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, ctypes.c_float,
                                                ptr, ctypes.c_int]
    lib.rad_decode_attention_planes.restype = None
    lib.rad_store_planes.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, i64, ctypes.c_int]
    lib.rad_store_planes.restype = None
    for name, older in (("rad_blocks_amx_rows", 0), ("rad_blocks_gemm_rows", 64)):
        if hasattr(lib, name):
            getattr(lib, name).argtypes, getattr(lib, name).restype = [ctypes.c_int], ctypes.c_int
        else:  # an older cpu_blocks.c (tools/bench_cpu_blocks.py --source): no AMX path, GEMM past 64 rows
            setattr(lib, name, lambda fmt, older=older: older)
    if hasattr(lib, "rad_blocks_swiglu"):
        lib.rad_blocks_swiglu.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, i64, ctypes.c_int, ptr, i64, ctypes.c_int]
        lib.rad_blocks_swiglu.restype = ctypes.c_int
    else:  # an older cpu_blocks.c: no fused SwiGLU, every call declined
        lib.rad_blocks_swiglu = lambda *args: -1
    return lib


def available() -> bool:
    """Whether the kernels are built (or can be) on this machine."""
    return _lib() is not None


def amx_rows(fmt: str) -> int:
    """Rows of x from which `matmul` runs `fmt` through the AMX path here (cpu_blocks.c's header), 0 where it
    does not."""
    return _lib().rad_blocks_amx_rows(FORMATS[fmt]) if available() else 0


def gemm_rows(fmt: str) -> int | None:
    """Rows of x past which `matmul` dequantizes W and multiplies by torch's GEMM (faster there on this machine:
    cpu_blocks.c's rad_blocks_gemm_rows), None where the block product takes every M."""
    return (_lib().rad_blocks_gemm_rows(FORMATS[fmt]) or None) if available() else None


def _check(data: torch.Tensor, fmt: str, shape: tuple[int, int]) -> tuple[int, int, int]:
    n, k = shape
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt} has no CPU block kernel; these do: {', '.join(FORMATS)}")
    block, row_bytes = ALL_FORMATS[fmt].block, ALL_FORMATS[fmt].row_bytes(k)
    # K's blocks must fit in a row: the kernels read K / block blocks from each row's start
    if data.dtype != torch.uint8 or data.device.type != "cpu" or data.dim() != 2 or data.shape[0] != n \
            or data.stride(1) != 1 or k % block or data.shape[1] != row_bytes:
        raise ValueError(f"{fmt} {list(shape)}: need CPU uint8 rows [N, {row_bytes} bytes] with unit stride and K a "
                         f"multiple of {block}, got {data.dtype} {list(data.shape)} on {data.device}")
    return n, k, data.stride(0)


class Matrix:
    """W [N, K] in `fmt`'s blocks (`data`: [N, row bytes] uint8), checked once, with the kernel's per-matrix
    arguments kept: `Matrix(data, fmt, shape)(x)` is `matmul(x, data, fmt, shape)`. It holds `data`, so
    the pointer it keeps stays valid while it lives.

    Why: a SmolLM2 decode step makes 151 block calls (5 a layer and the lm_head), and `matmul` spent ~10 us
    of Python a call around the ~3 us ctypes call (W's checks, a device object, reshapes of x and y, the
    library's lookup). A model's weights are the same objects every step, so the host backend keeps one of
    these per weight (kernels/cpu.py `_blocks`) and a call checks only x (dtype, device, K, unit stride: what
    keeps the C code inside x's memory) and allocates y. Measured on a 2 x 32 q8_0 matrix (the kernel's own time near
    0), 2 threads, x [1, 32]: 13.0 us a call through `matmul` before, 5.9 us through `__call__`, of which the
    ctypes call is 3.0 and `torch.empty` for y 1.2-1.4 (kernels/cpu.py `_matmul`: 15.4 -> 7.0 us)."""

    __slots__ = ("data", "fmt", "shape", "gemm_rows", "_w", "_run")

    def __init__(self, data: torch.Tensor, fmt: str, shape: tuple[int, int]):
        n, k, row_bytes = _check(data, fmt, shape)
        self.data, self.fmt, self.shape = data, fmt, (n, k)
        self._w = (data.data_ptr(), row_bytes, FORMATS[fmt])
        self._run = _lib().rad_blocks_matmul
        self.gemm_rows = gemm_rows(fmt)  # rows of x past which the call dequantizes W for torch's GEMM

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] fp32 @ W.T -> [..., N] fp32."""
        n, k = self.shape
        if x.dtype is not torch.float32:
            raise ValueError(f"x must be fp32, got {x.dtype}")
        if not x.is_cpu or x.dim() != 2:
            return self._general(x)
        (m, kx), (ldx, unit) = x.shape, x.stride()
        if kx != k or unit != 1:
            return self._general(x)
        if self.gemm_rows is not None and m > self.gemm_rows:
            return x @ dequantize(self.data, self.fmt, self.shape).t()
        y = torch.empty(m, n, dtype=torch.float32)
        if m:
            ptr, row_bytes, code = self._w
            self._run(x.data_ptr(), m, k, ldx, ptr, n, row_bytes, code, y.data_ptr(), n, torch.get_num_threads())
        return y

    def _general(self, x: torch.Tensor) -> torch.Tensor:
        """Any other x: leading dims flattened, rows made unit-stride, on the CPU (checked)."""
        n, k = self.shape
        if not x.is_cpu or x.shape[-1] != k:
            raise ValueError(f"x must be CPU fp32 [..., {k}], got {list(x.shape)} on {x.device}")
        x2 = x.reshape(-1, k)
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        return self(x2).reshape(*x.shape[:-1], n)


class SwiGLU:
    """An MLP's gate and up matrices (`Matrix`es of one format and shape) as one product: `SwiGLU(gate, up)(x)` is
    `F.silu(gate(x)) * up(x)` in one C call (cpu_blocks.c `rad_blocks_swiglu`: one parallel region, the silu in
    registers with cpu_exp.h's e^x, within 2 units of fp32 rounding of torch's; gate(x) and up(x) themselves are the
    products' values bit for bit); where the C call declines (past its rows of x, a long prefill; where the AMX path
    takes the format at that M, its products faster apart; a build without AVX2), the two products and torch's
    ops. `make` returns None where gate and up differ in format or shape."""

    __slots__ = ("gate", "up", "_run")

    def __init__(self, gate: Matrix, up: Matrix):
        self.gate, self.up = gate, up
        self._run = _lib().rad_blocks_swiglu

    @staticmethod
    def make(gate: Matrix, up: Matrix) -> SwiGLU | None:
        same = gate.fmt == up.fmt and gate.shape == up.shape and gate._w[1] == up._w[1]
        return SwiGLU(gate, up) if same else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] fp32 -> silu(x @ G.T) * (x @ U.T) [M, N] fp32."""
        n, k = self.gate.shape
        if x.dtype is torch.float32 and x.is_cpu and x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1 \
                and x.shape[0]:
            m = x.shape[0]
            y = torch.empty(m, n, dtype=torch.float32)
            (wg, row_bytes, code), wu = self.gate._w, self.up._w[0]
            if not self._run(x.data_ptr(), m, k, x.stride(0), wg, wu, n, row_bytes, code, y.data_ptr(), n,
                             torch.get_num_threads()):
                return y
        return torch.nn.functional.silu(self.gate(x)).mul_(self.up(x))


def matmul(x: torch.Tensor, data: torch.Tensor, fmt: str, shape: tuple[int, int]) -> torch.Tensor:
    """x [..., K] fp32 @ W.T -> [..., N] fp32, W [N, K] in `fmt`'s blocks (`data`: [N, row bytes] uint8).
    A caller with the same W every time keeps a `Matrix` instead (its checks made once)."""
    return Matrix(data, fmt, shape)(x)


def dequantize(data: torch.Tensor, fmt: str, shape: tuple[int, int]) -> torch.Tensor:
    """W [N, K] fp32, each value gguf's dequantization of it bit for bit."""
    n, k, row_bytes = _check(data, fmt, shape)
    out = torch.empty(n, k, dtype=torch.float32)
    _lib().rad_blocks_dequantize(data.data_ptr(), n, k, row_bytes, FORMATS[fmt], out.data_ptr(),
                                 torch.get_num_threads())
    return out


if __name__ == "__main__":  # `make install`: build once for this machine
    print(f"CPU block kernels: {build()}")
