"""Suite-wide settings.

The tests run tiny models whose ops are microseconds long; torch's intra-op
thread pool costs more than it saves there, and on a loaded 2-core CI machine
its spinning threads slowed the engine tests 60x (62 s vs 1 s for one test).
One thread keeps the suite fast and its timings stable.

`shm_dir`: a fresh folder on /dev/shm (a tmpfs), removed afterwards, for the
`ram=DIR` placements.
"""

import shutil
import uuid
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def shm_dir():
    """A fresh folder on /dev/shm (tmpfs), removed afterwards."""
    d = Path("/dev/shm") / f"radianced-test-{uuid.uuid4().hex[:12]}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)
