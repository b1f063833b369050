"""kernels/pdl.py off the GPU: no level without CUDA, and a clear error for a bad RADIANCED_PDL.
(The levels on a Hopper: tests/gpu/test_kernels_gpu.py.)"""

import pytest
import torch

import tests.kernels.interpreter  # noqa: F401  (before triton loads: the other kernel tests run interpreted)

from radianced.kernels import pdl


@pytest.fixture(autouse=True)
def fresh_level():
    pdl._level.cache_clear()
    yield
    pdl._level.cache_clear()


def test_off_without_cuda_at_every_level(monkeypatch):
    for lv in pdl.LEVELS:
        monkeypatch.setenv("RADIANCED_PDL", str(lv))
        pdl._level.cache_clear()
        assert pdl.level(torch.device("cpu")) == 0
        assert pdl.launch(torch.device("cpu"), 1) == {"PDL": 0, "launch_pdl": False}


def test_bad_level_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv("RADIANCED_PDL", "on")
    with pytest.raises(ValueError, match=r"RADIANCED_PDL='on': use one of 0, 1, 2, 3"):
        pdl.level(torch.device("cpu"))
