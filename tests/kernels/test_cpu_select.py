"""`ops.select` on the CPU binds the host backend's ops (kernels/cpu.py), which is also what the
model tests run on before any select; `oracle=True` binds the reference ops anywhere."""

from __future__ import annotations

from radianced.kernels import cpu, ops, reference


def test_the_cpu_binds_the_host_backend_ops_and_the_oracle_binds_the_reference():
    assert ops.rotary_paged_attention is cpu.rotary_paged_attention  # the import-time binding
    try:
        assert ops.select("cpu", oracle=True) == "reference"
        assert ops.rotary_paged_attention is reference.rotary_paged_attention
        assert ops.linear is reference.linear and ops.rms_norm is reference.rms_norm
        assert ops.silu_mlp is reference.silu_mlp and ops.moe is reference.moe
        assert ops.dense_layer is reference.dense_layer  # no fused layer: the model runs its ops
        assert ops.select("cuda", oracle=True) == "reference" and ops.linear is reference.linear
    finally:
        assert ops.select("cpu") == "cpu"
    assert ops.rotary_paged_attention is cpu.rotary_paged_attention
    assert ops.linear is cpu.linear and ops.rms_norm is cpu.rms_norm and ops.silu_mlp is cpu.silu_mlp
    assert ops.moe is cpu.moe and ops.route_moe is cpu.route_moe and ops.dense_layer is cpu.dense_layer
    assert ops.route is reference.route and ops.gated_delta_rule_chunked is reference.gated_delta_rule_chunked
