"""--host-pool-placement ram|ram=DIR: carried in Config, refused when it cannot work, and the
daemon's start-up check that DIR is a tmpfs folder."""

from __future__ import annotations

import re

import pytest

from radianced.config import Config, ConfigError, check_host, parse_config



def test_default_is_the_daemons_own_memory():
    c = parse_config([])
    assert c.host_pool_placement == "ram" and c.host_pool_ram_dir is None
    check_host(c)


def test_ram_dir_carries_the_folder(shm_dir):
    c = Config(host_pool_mib=512, host_pool_placement=f"ram={shm_dir}")
    assert c.host_pool_ram_dir == str(shm_dir)
    check_host(c)


def test_ram_dir_names_the_folder_the_pool_file_goes_in(shm_dir):
    cfg = parse_config(["--host-pool-mib", "512", "--host-pool-placement", f"ram={shm_dir}"])
    assert cfg.host_pool_ram_dir == str(shm_dir)
    assert parse_config(["--host-pool-placement", "ram"]).host_pool_ram_dir is None


@pytest.mark.parametrize("argv, message", [
    ("--host-pool-mib 64 --host-pool-placement vram", "--host-pool-placement 'vram': choose ram (the daemon's own "
     "memory) or ram=DIR (a file in the tmpfs DIR, shared by daemons on this host)"),
    ("--host-pool-mib 64 --host-pool-placement ram=", "--host-pool-placement 'ram=': choose ram"),
    ("--host-pool-mib 64 --host-pool-placement disk=/x", "--host-pool-placement 'disk=/x': choose ram"),
    ("--host-pool-placement ram=/dev/shm", "--host-pool-placement 'ram=/dev/shm': the host pool is empty "
     "(--host-pool-mib 0); give --host-pool-mib N"),
    ("--host-pool-mib 64 --placement resident --host-pool-placement ram=/dev/shm", "--placement resident keeps every "
     "expert on the card, so there is no host pool to share"),
])
def test_placements_that_cannot_work_are_refused(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(argv.split())


def test_start_up_refuses_a_missing_folder_and_one_not_on_tmpfs(tmp_path):
    with pytest.raises(ConfigError, match=rf"^--host-pool-placement ram={tmp_path}/no: no such folder; create it on "
                                          r"a tmpfs \(e.g. under /dev/shm\)$"):
        check_host(Config(host_pool_mib=64, host_pool_placement=f"ram={tmp_path}/no"))
    with pytest.raises(ConfigError, match=rf"^--host-pool-placement ram={tmp_path}: not a tmpfs \(file system type "
                                          r"0x[0-9a-f]+\); the shared pool must live in RAM: use a folder under "
                                          r"/dev/shm or mount a tmpfs$"):
        check_host(Config(host_pool_mib=64, host_pool_placement=f"ram={tmp_path}"))
