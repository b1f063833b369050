"""The norm, RoPE and Gated DeltaNet kernels on CUDA: each Triton op against its torch reference op,
and as a ratio to the device-copy bandwidth measured in the same run.

    python tools/bench_layer_kernels.py [--out DIR]      # DIR defaults to $OUT, else ./out

Writes DIR/bench_layer_kernels.json (rewritten after every case, so a run cut
short keeps what it measured) and prints one line per case. Shapes are the
products': Qwen3-30B-A3B (hidden 2048; 32 / 4 heads x 128, plain qk-norm, full
rotary) and Qwen3-Next-80B (16 / 2 heads x 256, zero-centred qk-norm, rotary 64;
DeltaNet 16 key / 32 value heads x 128, 8192 conv channels, W = 4, fp32 states),
bf16 activations, at decode batch 1 and 32 and a 4096-token prefill.

Each op is timed as CALLS calls on distinct buffers (no call finds its data in
the 60 MB L2) captured in one CUDA graph (the decode runner's mode), per call; the floor is the op's unavoidable bytes (inputs read, outputs
and states written) over the copy bandwidth (bytes read + written / time of a
2 GiB device-to-device copy), and ratio = floor / time. The chunked prefill
(fla-core) and its reference run eagerly (fla autotunes on first use) and have
no byte floor: they are compute-bound. `rotary_qk` is also timed unfused (two
Triton norms and two Triton rotations) to show what the fusion buys.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "tools"))

import torch  # noqa: E402

from bench_kernels import time_graph  # noqa: E402
from gpu_bench import timeit  # noqa: E402  (the CUDA-event timer every device benchmark shares)

CALLS = 10  # op calls per captured graph
HIDDEN = 2048
QWEN3 = (32, 4, 128, 128, False)  # Hq, Hk, D, rotary dim, zero-centred
NEXT = (16, 2, 256, 64, True)
HK, HV, DK, DV, C, W = 16, 32, 128, 128, 2 * 16 * 128 + 32 * 128, 4


def _rand(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(shape, device="cuda") * scale).to(dtype)


def copy_bandwidth() -> float:
    n = 2 << 30
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), "cuda", warmup=3, reps=20)
    return 2 * n / t["median_s"]


def _per_call(make, fn) -> float:
    """Seconds per call of fn(*make()), CALLS calls on distinct buffers (so no call finds its data in L2)."""
    args = [make() for _ in range(CALLS)]

    def many():
        for a in args:
            fn(*a)
    return time_graph(many)["median_s"] / CALLS


# -- cases: (name, make() -> args, {label: fn(*args)} with "triton" and "reference", floor bytes) -------


def norm_cases(norm, reference):
    w = _rand(HIDDEN)
    for t in (1, 32, 4096):
        yield (f"rms_norm zc t{t} h{HIDDEN}", lambda t=t: (_rand(t, HIDDEN),),
               {"triton": lambda x: norm.rms_norm(x, w, 1e-6, True),
                "reference": lambda x: reference.rms_norm(x, w, 1e-6, True)}, 2 * t * HIDDEN * 2)
    wv = _rand(DV)
    for t in (1, 32, 4096):
        yield (f"gated_rms_norm t{t} {HV}x{DV}", lambda t=t: (_rand(t, HV, DV), _rand(t, HV, DV)),
               {"triton": lambda x, z: norm.gated_rms_norm(x, z, wv, 1e-6),
                "reference": lambda x, z: reference.gated_rms_norm(x, z, wv, 1e-6)}, 3 * t * HV * DV * 2)


def rotary_cases(norm, rope, reference):
    for name, (hq, hk, d, rd, zc) in (("qwen3_moe", QWEN3), ("qwen3_next", NEXT)):
        qw, kw = _rand(d, scale=0.1), _rand(d, scale=0.1)
        for t in (1, 32, 4096):
            at = (torch.arange(t, device="cuda"), reference.rotary_inv_freq(rd, 1e6, "cuda"))

            def unfused(q, k, qw=qw, kw=kw, at=at, zc=zc):
                qn, kn = norm.rms_norm(q, qw, 1e-6, zc), norm.rms_norm(k, kw, 1e-6, zc)
                return rope.apply_rotary(qn, *at), rope.apply_rotary(kn, *at)

            yield (f"rotary_qk+norm {name} t{t}", lambda t=t, hq=hq, hk=hk, d=d: (_rand(t, hq, d), _rand(t, hk, d)),
                   {"triton": lambda q, k, qw=qw, kw=kw, at=at, zc=zc: rope.rotary_qk(q, k, *at, qw, kw, 1e-6, zc),
                    "reference": lambda q, k, qw=qw, kw=kw, at=at, zc=zc: reference.rotary_qk(
                        q, k, *at, qw, kw, 1e-6, zc),
                    "unfused_triton": unfused},
                   2 * t * (hq + hk) * d * 2 + t * 8 + rd * 2)


def deltanet_cases(deltanet, reference):
    a_log, dt_bias, conv_w = _rand(HV, dtype=torch.float32), _rand(HV), _rand(C, W)
    for b in (1, 32):
        yield (f"deltanet_gates b{b}", lambda b=b: (_rand(b, HV), _rand(b, HV)),
               {"triton": lambda a, bb: deltanet.deltanet_gates(a, bb, a_log, dt_bias),
                "reference": lambda a, bb: reference.deltanet_gates(a, bb, a_log, dt_bias)}, b * HV * 2 * 4)
        yield (f"causal_conv1d_update b{b} c{C}", lambda b=b: (_rand(b, C), _rand(b, C, W - 1)),
               {"triton": lambda x, conv: deltanet.causal_conv1d_update(x, conv_w, conv),
                "reference": lambda x, conv: reference.causal_conv1d_update(x, conv_w, conv)},
               b * C * 2 * (2 + 2 * (W - 1)) + C * W * 2)

        def decode_inputs(b=b):
            return (_rand(b, HK, DK), _rand(b, HK, DK), _rand(b, HV, DV), -torch.rand((b, HV), device="cuda"),
                    _rand(b, HV).sigmoid(), _rand(b, HV, DK, DV, dtype=torch.float32, scale=0.1))

        yield (f"gated_delta_rule_decode b{b} fp32 state", decode_inputs,
               {"triton": lambda *a: deltanet.gated_delta_rule_decode(*a, use_qk_l2norm=True),
                "reference": lambda *a: reference.gated_delta_rule_decode(*a, use_qk_l2norm=True)},
               b * HV * DK * DV * 4 * 2 + b * (2 * HK * DK + 2 * HV * DV) * 2)
    t = 4096
    yield (f"causal_conv1d_prefill t{t} c{C}", lambda: (_rand(t, C), _rand(C, W - 1)),
           {"triton": lambda x, s: deltanet.causal_conv1d_prefill(x, conv_w, s),
            "reference": lambda x, s: reference.causal_conv1d_prefill(x, conv_w, s)}, 2 * t * C * 2)


def chunked_case(deltanet, reference, t: int = 4096) -> dict:
    q, k, v = _rand(t, HK, DK), _rand(t, HK, DK), _rand(t, HV, DV)
    g, beta = -torch.rand((t, HV), device="cuda") * 0.1, _rand(t, HV).sigmoid()
    state = _rand(HV, DK, DV, dtype=torch.float32, scale=0.1)
    start = time.monotonic()
    deltanet.gated_delta_rule_chunked(q, k, v, g, beta, state, use_qk_l2norm=True)  # fla autotunes here
    torch.cuda.synchronize()
    first = time.monotonic() - start
    ours = timeit(lambda: deltanet.gated_delta_rule_chunked(q, k, v, g, beta, state, use_qk_l2norm=True),
                  "cuda", warmup=2, reps=10)
    ref = timeit(lambda: reference.gated_delta_rule_chunked(q, k, v, g, beta, state, use_qk_l2norm=True),
                 "cuda", warmup=1, reps=3)
    return {"case": f"gated_delta_rule_chunked t{t} (fla-core, eager)", "first_call_s": first,
            "triton_s": ours["median_s"], "reference_s": ref["median_s"],
            "speedup": ref["median_s"] / ours["median_s"], "tokens_per_s": t / ours["median_s"]}


# -- driver ----------------------------------------------------------------------------------------


def measure(case, hbm: float) -> dict:
    name, make, fns, floor_bytes = case
    row = {"case": name, **{f"{label}_s": _per_call(make, fn) for label, fn in fns.items()}}
    floor = floor_bytes / hbm
    row.update(speedup=row["reference_s"] / row["triton_s"], floor_bytes=floor_bytes, floor_s=floor,
               ratio=floor / row["triton_s"])
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_layer_kernels: needs CUDA")
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    from radianced.kernels import deltanet, norm, reference, rope

    hbm = copy_bandwidth()
    result = {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": hbm, "calls_per_graph": CALLS,
              "cases": []}
    print(f"device copy: {hbm / 1e12:.2f} TB/s (read + written)", flush=True)
    path = out_dir / "bench_layer_kernels.json"
    cases = [*norm_cases(norm, reference), *rotary_cases(norm, rope, reference), *deltanet_cases(deltanet, reference)]
    for case in cases:
        try:
            row = measure(case, hbm)
        except Exception:  # one broken case must not hide the others' numbers
            row = {"case": case[0], "error": traceback.format_exc(limit=3)}
            print(f"{case[0]}: FAILED\n{row['error']}", flush=True)
        else:
            unfused = f", unfused {row['unfused_triton_s'] * 1e6:.1f} us" if "unfused_triton_s" in row else ""
            print(f"{row['case']}: {row['triton_s'] * 1e6:.1f} us (reference {row['reference_s'] * 1e6:.1f} us, "
                  f"x{row['speedup']:.1f}{unfused}), floor {row['floor_s'] * 1e6:.2f} us, "
                  f"{row['ratio']:.0%} of copy bandwidth", flush=True)
        result["cases"].append(row)
        path.write_text(json.dumps(result, indent=1))
    try:
        row = chunked_case(deltanet, reference)
        print(f"{row['case']}: {row['triton_s'] * 1e3:.2f} ms (reference {row['reference_s'] * 1e3:.1f} ms, "
              f"x{row['speedup']:.1f}), {row['tokens_per_s'] / 1e6:.2f} M tokens/s per layer; "
              f"first call {row['first_call_s']:.1f} s", flush=True)
    except Exception:
        row = {"case": "gated_delta_rule_chunked", "error": traceback.format_exc(limit=3)}
        print(f"chunked: FAILED\n{row['error']}", flush=True)
    result["cases"].append(row)
    path.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
