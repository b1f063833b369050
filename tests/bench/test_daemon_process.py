"""--start reads the daemon's limits from its own flags, and refuses flags radianced would refuse."""

from __future__ import annotations

import pytest

from radianced.bench.daemon_process import daemon_config
from radianced.config import ConfigError


def test_the_limits_come_from_the_daemon_flags():
    cfg = daemon_config(["--max-num-seqs", "8", "--max-queue", "4", "--max-model-len", "512"])
    assert (cfg.max_num_seqs, cfg.max_queue, cfg.max_model_len) == (8, 4, 512)


def test_an_unknown_flag_is_a_config_error_not_an_exit():
    with pytest.raises(ConfigError, match="--no-such-flag"):
        daemon_config(["--no-such-flag"])

