"""Compile the attention and MoE launches for Hopper (sm_90) without a GPU: what the interpreter cannot see.

    python -m tests.kernels.hopper_compile [--shard I/N]   # a line a case; exit 1 on a compile error or a spill

The interpreter (tests/kernels/interpreter.py) runs a kernel's Python, so a kernel that only
Triton's compiler refuses passes every CPU test: on the H200, `kv_int.dot_operand` written as a
static `if` with two returns of different dtypes stopped every quantized cache's attention from
compiling ("at 99:12"), after its interpreter tests had passed. Here Triton's own compiler and
the ptxas its wheel carries build the real kernels: `compile_only` puts a stand-in driver that
names an sm_90 target and launches nothing (each launch returns once its kernel is built). The
steps (`attention_step`) are test_attention's `Step` (an auto cache, qk-norm) and
test_attention_kv_quant's (each quantized format): decode (the fused write) and prefill, bf16 and
fp32 activations, at the tests' small shape and Qwen3-30B-A3B's (32 / 4 heads x 128); and the routed
MoE (`moe_step`) over bf16 and each compact format at T = 1, 3 (GGUF: the few-rows path, at T = 3 unsorted
without the in-launch sum) and 32, and the Gated DeltaNet's decode and verify launches (`deltanet_step`),
compiled only. Each attention key
loop in bf16 (`loop_mix`, from the wheel's nvdisasm) must not spill registers: an int6 K's decode
did at 4 warps (243 local loads, 241 stores a key tile). fp32 activations (IEEE dots: FMAs, the
tiny families' correctness path on a GPU) are only compiled; their prefill loops spill. Run in a
process of its own: `@triton.jit` decides at import whether it interprets. tools/sass_loop.py
prints a loop's instruction mix.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import CompiledKernel
from triton.runtime.jit import JITFunction

from radianced.kernels.formats import is_staged

TARGET = GPUTarget("cuda", 90, 32)  # the H200's
KV_DTYPES = ("auto", "fp8", "fp8_v4", "k6_v4")


class _CompileOnly:
    """The driver Triton asks for the device, stream and target: sm_90, and no device behind it."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def compile_only() -> list[tuple[str, CompiledKernel]]:
    """From now on this process builds kernels for sm_90 and launches none; returns the list each
    built kernel is appended to, as (its function's name, the kernel)."""
    triton.runtime.driver.set_active(_CompileOnly())
    CompiledKernel._init_handles = lambda self: None  # no binary is loaded, nothing launched
    CompiledKernel.launch_metadata = lambda self, *a: None
    CompiledKernel.run = lambda *a, **k: None
    built: list[tuple[str, CompiledKernel]] = []
    compile_kernel = JITFunction._do_compile

    def record(self, *args, **kwargs):
        kernel = compile_kernel(self, *args, **kwargs)
        built.append((self.fn.__name__, kernel))
        return kernel

    JITFunction._do_compile = record
    stub = types.ModuleType("tests.kernels.interpreter")  # the tests' interpreter switch, off
    stub.DEVICE = "cpu"
    stub.require_interpreted = lambda *a, **k: None
    sys.modules["tests.kernels.interpreter"] = stub
    return built


def attention_step(kv_dtype: str, dtype: torch.dtype, decode: bool, heads: tuple[int, int, int] = (8, 2, 64),
                   contexts: tuple[int, int] = (40, 36), prefill: int = 17) -> None:
    """One attention step through the launches the engine uses (`compile_only` first)."""
    from tests.kernels import test_attention, test_attention_kv_quant

    hq, hkv, d = heads
    q_lens = [1, 1] if decode else [min(5, contexts[0]), min(prefill, contexts[1])]
    if kv_dtype == "auto":
        step = test_attention.Step(q_lens, list(contexts), hq, hkv, d, d, qk_norm=True, dtype=dtype)
    else:
        step = test_attention_kv_quant.Step(q_lens, list(contexts), hq, hkv, d, dtype, seed=1, kv_dtype=kv_dtype)
    step.fused(decode=decode)


def moe_step(fmt: str, tokens: int, experts: int = 8, hidden: int = 2048, inter: int = 768, top_k: int = 8) -> None:
    """One routed-MoE step (`moe.moe`, bf16 activations) over `experts` experts of Qwen3-30B-A3B's widths,
    bf16 (`fmt` "bf16") or compact (test_moe_compact's formats), one expert in host rows (`compile_only`
    first); GGUF experts also with that expert staged (kernels/stage.py: its launches and the MoE's over the
    step's pointer table)."""
    from tests.kernels import test_moe, test_moe_compact

    for module in (test_moe, test_moe_compact):  # the harnesses' shapes, widened
        module.E, module.H, module.I = experts, hidden, inter
    test_moe_compact.HOST_EXPERTS, test_moe_compact.SPARE = {1: 0}, 1
    if fmt == "bf16":
        test_moe.Experts(tokens, top_k, torch.bfloat16).kernel()
    else:
        experts = test_moe_compact.CompactExperts(fmt, tokens, top_k, torch.bfloat16)
        experts.kernel()
        if is_staged(fmt):
            experts.kernel(host=True, staging=torch.empty((2, experts.host.shape[1]), dtype=torch.uint8))


def deltanet_step(dtype: torch.dtype) -> None:
    """The Gated DeltaNet's per-token launches (`compile_only` first) at Qwen3-Next-80B-A3B's widths (16 key and
    32 value heads of 128, conv width 4): a decode of 2 sequences over state slots, and a verify step of two
    sequences' 5 positions (a last token and 4 drafts; one token) beside a prompt chunk they leave alone."""
    from radianced.kernels import deltanet
    t, hk, hv, d, w = 5, 16, 32, 128, 4
    c = (2 * hk + hv) * d
    slots = torch.zeros(2, dtype=torch.int64)
    conv = torch.zeros(2 * (1 + 4), c, w - 1, dtype=dtype)
    rec = torch.zeros(2 * (1 + 4), hv, d, d)
    x, weight = torch.zeros(t, c, dtype=dtype), torch.zeros(c, w, dtype=dtype)
    q, v = torch.zeros(t, hk, d, dtype=dtype), torch.zeros(t, hv, d, dtype=dtype)
    g, beta = torch.zeros(t, hv), torch.zeros(t, hv, dtype=dtype)
    deltanet.causal_conv1d_update(x[:2], weight, conv, slots)
    deltanet.gated_delta_rule_decode(q[:2], q[:2], v[:2], g[:2], beta[:2], rec, slots, use_qk_l2norm=True)
    starts, verify = torch.tensor([0, 0, 4, 5], dtype=torch.int32), torch.tensor([-1, 1, 0])
    deltanet.causal_conv1d_verify(x, weight, conv, starts, verify, 2, 4)
    deltanet.gated_delta_rule_verify(q, q, v, g, beta, rec, starts, verify, 2, 4, use_qk_l2norm=True)


def disassemble(cubin: bytes) -> str:
    """The whole SASS of `cubin` (the wheel's nvdisasm; Triton's `get_sass` cut k6_v4's decode kernel short,
    before its key loop)."""
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout


def loop_mix(sass: str) -> dict:
    """The loop (a branch back to a label above it) of nvdisasm's `sass` with the most dot instructions (HMMA,
    or Hopper's HGMMA), the longest of those: {instructions, ops}."""
    labels, body = {}, []  # label -> index of the instruction after it; the instructions' text
    for line in sass.splitlines():
        if m := re.match(r"^(\.L_x_\d+):", line):
            labels[m[1]] = len(body)
        elif m := re.match(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line):
            body.append(m[1])
    if not any(text.startswith("EXIT") or " EXIT" in text for text in body):
        raise RuntimeError("the disassembly has no EXIT: it is incomplete")
    loops = [(labels[m[1]], i) for i, text in enumerate(body)
             if (m := re.search(r"BRA\s+`\((\.L_x_\d+)\)", text)) and labels.get(m[1], i + 1) <= i]
    if not loops:
        return {"instructions": 0, "ops": {}}

    def dots(r):
        return sum("MMA" in text for text in body[r[0]:r[1] + 1]), r[1] - r[0]

    lo, hi = max(loops, key=dots)
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0] for text in body[lo:hi + 1])
    return {"instructions": hi - lo + 1, "ops": dict(ops.most_common())}


MOE_FORMATS = ("bf16", "q8_0", "q4_0", "q4_1", "fp8_b128", "q4_0+q8_0")  # the routed MoE's experts
# (heads: Hq, Hkv, D; contexts; activations): the tests' small shape, and Qwen3-30B-A3B's in bf16
CASES = (((8, 2, 64), (40, 36), (torch.bfloat16, torch.float32)), ((32, 4, 128), (120, 120), (torch.bfloat16,)))


def cases() -> list[tuple[str, tuple]]:
    """Every case, in order: ("attention", (kv_dtype, dtype, decode, heads, contexts)), ("moe", (fmt, tokens)) and
    ("deltanet", (dtype,))."""
    out = [("attention", (kv_dtype, dtype, decode, heads, contexts)) for heads, contexts, dtypes in CASES
           for kv_dtype in KV_DTYPES for dtype in dtypes for decode in (True, False)]
    # MoE and the DeltaNet compiled only: the GGUF gate/up loops spill a little at T = 32 (issue 20)
    return (out + [("moe", (fmt, tokens)) for fmt in MOE_FORMATS for tokens in (1, 3, 32)]
            + [("deltanet", (dtype,)) for dtype in (torch.bfloat16, torch.float32)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shard", default="0/1", metavar="I/N",
                    help="every N-th case from the I-th (0-based), so N processes share the compiles")
    i, n = (int(x) for x in ap.parse_args(argv).shard.split("/"))
    built = compile_only()
    failed = spilled = 0
    for kind, args in cases()[i::n]:
        if kind == "moe":
            fmt, tokens = args
            case = f"moe {fmt} T={tokens}"
        elif kind == "deltanet":
            case = f"deltanet {str(args[0])[6:]}"
        else:
            kv_dtype, dtype, decode, heads, contexts = args
            case = f"{kv_dtype} {str(dtype)[6:]} {heads} {'decode' if decode else 'prefill'}"
        before = len(built)
        try:
            {"moe": moe_step, "deltanet": deltanet_step, "attention": attention_step}[kind](*args)
        except triton.CompilationError as e:
            failed += 1
            print(f"{case}: {type(e).__name__}: {e}", flush=True)
            continue
        names = ", ".join(n for n, _ in built[before:]) or "nothing new"
        if kind != "attention" or args[1] != torch.bfloat16:  # fp32's IEEE dots are FMAs: a correctness path
            print(f"{case}: built {names}", flush=True)
            continue
        kernel = next(k for n, k in reversed(built) if n == "_paged_attention_kernel")
        ops = loop_mix(disassemble(kernel.asm["cubin"]))["ops"]
        local = ops.get("LDL", 0) + ops.get("STL", 0)  # registers spilled in the key loop
        spilled += local > 0
        print(f"{case}: built {names}; the key loop {sum(ops.values())} instructions"
              + (f", {local} of them to local memory (spills)" if local else ""), flush=True)
    print(f"{len(built)} kernels built for sm_{TARGET.arch}; {failed} cases did not compile, {spilled} spill")
    return 1 if failed or spilled or not built else 0


if __name__ == "__main__":
    raise SystemExit(main())
