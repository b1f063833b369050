"""`--host-pool-placement ram=DIR`: two real daemons on one host share one copy of the host pool.

Tiny Qwen3-MoE with 6 slots and 24 experts in the host pool. The first daemon
fills the pool file in the tmpfs DIR, the second maps the same inode as it is;
the tmpfs holds one pool's worth of blocks, not two, and both serve the same
greedy tokens. A folder that is not a tmpfs stops the daemon before it loads.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import torch

from tests.server.conftest import start_daemon
from tests.server.test_daemon_experts import FLAGS, PROMPT, moe_model  # noqa: F401  (a fixture)



def greedy_text(d) -> str:
    with httpx.Client(base_url=d.url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def mappings(pid: int, path: Path) -> set[tuple[str, int]]:
    """(permissions, inode) of every mapping of `path` in process `pid`."""
    out = set()
    for line in open(f"/proc/{pid}/maps"):
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].strip() == str(path):
            out.add((fields[1], int(fields[4])))
    return out


def test_two_daemons_map_one_copy_of_the_host_pool(moe_model, shm_dir):  # noqa: F811
    flags = (*FLAGS, "--host-pool-placement", f"ram={shm_dir}")
    a = start_daemon(moe_model, *flags)
    try:
        b = start_daemon(moe_model, *flags)
        try:
            assert greedy_text(a) == greedy_text(b)
            pools = [p for p in shm_dir.iterdir() if not p.name.endswith((".ready", ".lock"))]
            assert len(pools) == 1
            pool = pools[0]
            st = pool.stat()
            assert st.st_blocks * 512 == st.st_size > 0  # the tmpfs holds one copy
            for d in (a, b):  # each maps that inode shared, read-write
                assert mappings(d.pid, pool) == {("rw-s", st.st_ino)}
            pinned = "pinned" if torch.cuda.is_available() else "not pinned (no CUDA)"  # the daemons' device
            assert f"in tmpfs file {pool}, {pinned}; filled with O_DIRECT" in a.log()
            assert f"in tmpfs file {pool}, {pinned}; filled by another process, mapped as is" in b.log()
        finally:
            assert b.stop() == 0, b.log()[-3000:]
    finally:
        assert a.stop() == 0, a.log()[-3000:]


def test_a_folder_that_is_not_a_tmpfs_stops_the_daemon_before_loading(moe_model, tmp_path):  # noqa: F811
    r = subprocess.run([sys.executable, "-m", "radianced.cli", "--model", str(moe_model), "--host-pool-mib", "1",
                        "--host-pool-placement", f"ram={tmp_path}"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "NOTIFY_SOCKET": ""})
    assert r.returncode == 2
    assert f"radianced: error: --host-pool-placement ram={tmp_path}: not a tmpfs (file system type " in r.stderr
    assert "use a folder under /dev/shm or mount a tmpfs" in r.stderr
