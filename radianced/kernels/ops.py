"""The one switch between the op sets: Triton kernels (CUDA), the host backend's ops (CPU)
and the fp32 torch reference (the oracle).

Model code calls `ops.<name>` (looked up at call time), so binding these names
once at model load switches every layer; no layer branches on the backend.
`select(device)` does that binding; until it is called every name is the CPU
op (the host backend, and the tests that run a model). Ops with no kernel of a
set stay the reference there.
"""

from __future__ import annotations

import functools
import importlib

import torch

from radianced.kernels import cpu, reference

rms_norm = cpu.rms_norm
gated_rms_norm = reference.gated_rms_norm
rotary_inv_freq = reference.rotary_inv_freq  # made once per device: torch everywhere
linear = cpu.linear
silu_mlp = cpu.silu_mlp
rotary_paged_attention = cpu.rotary_paged_attention
moe = cpu.moe
route = reference.route
route_moe = cpu.route_moe
argmax = reference.argmax
dense_layer = cpu.dense_layer
gather_rows = reference.gather_rows

deltanet_gates = reference.deltanet_gates
causal_conv1d_prefill = reference.causal_conv1d_prefill
causal_conv1d_update = reference.causal_conv1d_update
causal_conv1d_verify = reference.causal_conv1d_verify
gated_delta_rule_chunked = reference.gated_delta_rule_chunked
gated_delta_rule_decode = reference.gated_delta_rule_decode
gated_delta_rule_verify = reference.gated_delta_rule_verify

# Bound to Triton on CUDA: (module under radianced.kernels, op name). The others stay torch everywhere.
_TRITON = (
    ("attention", "rotary_paged_attention"), ("moe", "moe"), ("moe", "route_moe"), ("router", "route"),
    ("linear", "linear"), ("linear", "silu_mlp"), ("argmax", "argmax"), ("embedding", "gather_rows"),
    ("norm", "rms_norm"), ("norm", "gated_rms_norm"),
    ("deltanet", "deltanet_gates"), ("deltanet", "causal_conv1d_prefill"), ("deltanet", "causal_conv1d_update"),
    ("deltanet", "gated_delta_rule_chunked"), ("deltanet", "gated_delta_rule_decode"),
    ("deltanet", "causal_conv1d_verify"), ("deltanet", "gated_delta_rule_verify"),
)
_SWITCHED = tuple(name for _, name in _TRITON)
# Bound to the host backend's ops (kernels/cpu.py) on the CPU; the others stay the reference there.
_CPU = ("rms_norm", "linear", "silu_mlp", "rotary_paged_attention", "moe", "route_moe", "dense_layer")


def select(device: torch.device | str, deterministic: bool = False, oracle: bool = False) -> str:
    """Bind the op names for `device`'s backend: Triton kernels on CUDA, the host backend's ops
    (kernels/cpu.py) elsewhere, or the fp32 reference ops anywhere with `oracle` (the tests' baseline).

    Call once at model load, before the first forward (and before any CUDA graph
    capture), from the thread that will run the model. `deterministic` (the
    `--deterministic` flag) makes the MoE scatter (`moe`, `route_moe`) a
    fixed-order sum instead of atomics. Rebinding is global to the process: one
    backend per process.
    Returns "triton", "cpu" or "reference".
    """
    g = globals()
    if oracle or torch.device(device).type != "cuda":
        for name in _SWITCHED + _CPU:
            g[name] = getattr(reference, name)
        if oracle:
            return "reference"
        for name in _CPU:
            g[name] = getattr(cpu, name)
        return "cpu"
    for name in _CPU:  # the host backend's ops that the Triton set has no kernel for stay the reference
        g[name] = getattr(reference, name)
    # Imported here so the CPU path (and the CPU oracle tests) never import triton (nor fla).
    for module, name in _TRITON:
        g[name] = getattr(importlib.import_module(f"radianced.kernels.{module}"), name)
    if deterministic:
        for name in ("moe", "route_moe"):
            g[name] = functools.partial(g[name], deterministic=True)
    return "triton"
