"""use_expandable_segments: a user's own allocator configuration naming expandable segments is kept."""

from __future__ import annotations

import pytest

from radianced.cuda_allocator import use_expandable_segments


@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_the_users_setting_is_kept_and_named(monkeypatch, var):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv(var, "expandable_segments:False,max_split_size_mb:128")
    line = use_expandable_segments()
    assert line == "cuda allocator: expandable_segments:False,max_split_size_mb:128 (from the environment)"
