"""Run the Triton kernels on the CPU: import this before anything imports triton.

Without CUDA, TRITON_INTERPRET=1 makes `@triton.jit` kernels run in Triton's
interpreter on CPU tensors (it must be set before triton's import: kernels are
decorated at import). Also patches the interpreter's bf16 dot (below).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0) -> torch.Tensor:
    """Seeded normal values on DEVICE (drawn on the CPU: every device gets the same ones), times `scale`."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


def require_interpreted(kernel, module: str) -> None:
    """Skip the calling module if `kernel` was decorated before TRITON_INTERPRET was set."""
    if isinstance(kernel, InterpretedFunction) != INTERPRET:
        pytest.skip(f"radianced.kernels.{module} was imported before TRITON_INTERPRET was set; "
                    "run tests/kernels in its own pytest process", allow_module_level=True)


def _interpreter_multiplies_bf16() -> None:
    """Triton 3.7's interpreter feeds bf16 `tl.dot` operands to numpy as their raw uint16 bits
    (garbage products); upcast them to fp32 first, as the GPU's bf16 MMA does exactly."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot
    if getattr(dot, "bf16_upcast", False):
        return

    def create_dot(self, a, b, d, *args):
        def up(x):
            if x.dtype.scalar != tl.bfloat16:
                return x
            data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)
        return dot(self, up(a), up(b), d, *args)

    create_dot.bf16_upcast = True
    interpreter.InterpreterBuilder.create_dot = create_dot


def _interpreter_rounds_bf16() -> None:
    """Triton 3.7's interpreter casts fp32 to bf16 by truncation (the GPU rounds to nearest
    even); kernels that round in between, as the references do, drift by several bf16 ulps.
    Round to nearest even instead (NaN aside, which no test feeds)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    cast = interpreter.InterpreterBuilder.cast_impl
    if getattr(cast, "bf16_rtne", False):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            return interpreter.TensorHandle(bits.reshape(np.shape(src.data)), tl.bfloat16)
        return cast(self, src, dst_type)

    cast_impl.bf16_rtne = True
    interpreter.InterpreterBuilder.cast_impl = cast_impl


def _interpreter_converts_fp8() -> None:
    """Triton 3.7's interpreter converts to E4M3 (fp8e4nv) by rounding half up without carrying a
    rounded-up mantissa into the exponent (1.9375 becomes 1.0); the GPU's `cvt.rn.satfinite` rounds
    to nearest even. Convert to and from E4M3 through torch instead, which rounds as the GPU does
    (the fp8 KV cache's bytes are tested bit for bit against torch's)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    to_fp = interpreter.InterpreterBuilder.create_fp_to_fp
    if getattr(to_fp, "fp8_torch", False):
        return
    dtypes = {  # tl dtype: (torch dtype, torch dtype of its bits, numpy dtype of the interpreter's data)
        tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8, np.uint8), tl.float32: (torch.float32,) * 2 + (np.float32,),
        tl.float16: (torch.float16,) * 2 + (np.float16,), tl.bfloat16: (torch.bfloat16, torch.int16, np.uint16)}

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        a, b = src.dtype.scalar, dst_type.scalar
        if tl.float8e4nv not in (a, b):
            return to_fp(self, src, dst_type, rounding_mode)
        (a_torch, a_bits, _), (b_torch, b_bits, b_np) = dtypes[a], dtypes[b]
        x = torch.from_numpy(np.ascontiguousarray(src.data)).view(a_bits).view(a_torch)  # ndim >= 1
        y = x.to(b_torch).view(b_bits).numpy().view(b_np).reshape(np.shape(src.data))
        return interpreter.TensorHandle(y, b)

    create_fp_to_fp.fp8_torch = True
    interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp


if INTERPRET:
    _interpreter_multiplies_bf16()
    _interpreter_rounds_bf16()
    _interpreter_converts_fp8()
