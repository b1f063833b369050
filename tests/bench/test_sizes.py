"""Workload sizes from the mode and the daemon's limits."""

from __future__ import annotations

from radianced.bench.sizes import OVERLOAD_EXCESS, STABILITY_MIN_S, DaemonLimits, Sizes


def test_the_default_mode_runs_the_issue_sizes():
    s = Sizes.choose(DaemonLimits(16, 128, 32768), quick=False, full=False)
    assert s.prefill_lengths == (4096, 16384) and s.sweep == (1, 2, 4, 8, 16)
    assert s.overload_requests == 16 + 128 + OVERLOAD_EXCESS and s.stability_s == 0.0


def test_prompts_never_pass_the_context_and_the_sweep_never_passes_admission():
    s = Sizes.choose(DaemonLimits(4, 2, 512), quick=False, full=False)
    assert s.prefill_lengths == (510, 510)  # one output token fits after each
    assert s.sweep == (1, 2, 4)  # c = 8 would get 429s: 4 slots + 2 waiting
    assert s.sweep_tokens + s.sweep_prompt_tokens <= 512 and s.overload_requests == 4 + 2 + 32


def test_full_adds_a_stability_pass_of_at_least_ten_minutes():
    limits = DaemonLimits(16, 128, 4096)
    assert Sizes.choose(limits, quick=False, full=True, stability_s=60).stability_s == STABILITY_MIN_S
    assert Sizes.choose(limits, quick=False, full=True, stability_s=900).stability_s == 900
    assert Sizes.choose(limits, quick=True, full=False, stability_s=900).stability_s == 0.0
