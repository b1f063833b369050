"""The one switch between Triton kernels (CUDA) and the torch reference (CPU).

Model code calls `ops.<name>` (looked up at call time), so binding these names
once at model load switches every layer; no layer branches on the backend. Until
the GPU kernels land, every name is the reference op.
"""

from __future__ import annotations

from radianced.kernels import reference

rms_norm = reference.rms_norm
gated_rms_norm = reference.gated_rms_norm
rotary_cos_sin = reference.rotary_cos_sin
apply_rotary = reference.apply_rotary
silu_mlp = reference.silu_mlp
write_kv = reference.write_kv
paged_attention = reference.paged_attention
moe = reference.moe

deltanet_gates = reference.deltanet_gates
causal_conv1d_prefill = reference.causal_conv1d_prefill
gated_delta_rule_chunked = reference.gated_delta_rule_chunked
