"""The kernel-build log (kernels/compiles.py): what Triton's compile hook reports lands under the phase of
the moment, reaches the listeners, and a hook installed before it still runs.

No GPU here: the hook is called as Triton's `JITFunction._do_compile` calls it after a variant is built
(its keyword arguments); tests/gpu/test_no_compile.py holds the whole claim on a GPU."""

from __future__ import annotations

import types

import pytest

triton = pytest.importorskip("triton")

from radianced.kernels.compiles import CompileLog  # noqa: E402


def built(name: str) -> None:
    """Triton's post-compile hook call for a variant of kernel `name`."""
    fn = types.SimpleNamespace(name=name)
    triton.knobs.runtime.jit_post_compile_hook(key=f"key-of-{name}", repr=f"{name}[...]", fn=fn,
                                                compile={"constants": {"BLOCK": 16}}, is_manual_warmup=False,
                                                already_compiled=False)


def test_builds_are_counted_by_phase_and_reach_the_listeners():
    log = CompileLog.install()
    assert CompileLog.install() is log  # one per process: Triton's hook is one global
    seen = []
    log.listeners.append(seen.append)
    start, serving = log.count("start-up"), log.count("serving")
    phase = log.phase
    try:
        log.phase = "start-up"
        built("_a_kernel")
        log.phase = "serving"
        built("_b_kernel")
        built("_b_kernel")
    finally:
        log.phase = phase
        log.listeners.remove(seen.append)
    assert (log.count("start-up") - start, log.count("serving") - serving) == (1, 2)
    assert [(b.kernel, b.kind, b.phase) for b in seen] == [("_a_kernel", "compile", "start-up"),
                                                          ("_b_kernel", "compile", "serving"),
                                                          ("_b_kernel", "compile", "serving")]
    assert "BLOCK" in seen[0].detail and "key-of-_a_kernel" in seen[0].detail
    assert log.by_kernel("serving")["_b_kernel"] >= 2


def test_a_hook_installed_before_still_runs(monkeypatch):
    """The log chains to whatever hook was there (a profiler's, say) instead of replacing it."""
    calls = []
    monkeypatch.setattr(CompileLog, "_installed", None)
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", lambda **kw: calls.append(kw["fn"].name))
    monkeypatch.setattr(triton.runtime.autotuner.Autotuner, "run", triton.runtime.autotuner.Autotuner.run)
    log = CompileLog.install()
    built("_c_kernel")
    assert calls == ["_c_kernel"] and log.count() == 1
