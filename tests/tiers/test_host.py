"""The host pool: O_DIRECT fill of real extents, and one tmpfs copy shared by two real processes."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import xxhash

from radianced.model.rad import RadFile
from radianced.tiers.host import HostPool, HostPoolError

KEYS = [(0, 3), (1, 0), (1, 7), (2, 15), (0, 0)]
ALL = [(layer, e) for layer in range(3) for e in range(16)]
ROW = 12288


@pytest.fixture(scope="module")
def rad(tier_rad):
    with RadFile.open(tier_rad) as r:
        yield r



def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_rows_hold_the_files_extents(rad, expert_bytes):
    pool = HostPool.create(rad, KEYS, pin=False)
    assert (len(pool), pool.row_bytes, pool.nbytes, pool.elems) == (5, ROW, 5 * ROW, 3 * 24 * 64)
    assert pool.tensor.shape == (5, ROW // 2) and pool.tensor.dtype == torch.bfloat16
    for i, k in enumerate(KEYS):
        assert pool.row_index(*k) == i
        assert pool.row(*k).shape == (3 * 24 * 64,)
        assert as_bytes(pool.row(*k)) == expert_bytes(rad, *k)
    gate, up, down = rad.expert(2, 15)
    assert torch.equal(pool.row(2, 15), torch.cat((gate.flatten(), up.flatten(), down.flatten())))
    assert not pool.pinned and pool.path is None and pool.filled_here
    assert pool.fill.experts == 5 and pool.fill.bytes == 5 * 9216
    assert pool.line().startswith("host pool: 5 experts (0.06 MiB) in anonymous memory, not pinned (no CUDA); "
                                  "filled with O_DIRECT in ")
    with pytest.raises(KeyError):
        pool.row(2, 14)


def test_rows_can_be_the_receipts_page_size(rad, expert_bytes):
    pool = HostPool.create(rad, KEYS, row_bytes=16384, pin=False)
    assert pool.tensor.stride() == (8192, 1)
    assert all(as_bytes(pool.row(*k)) == expert_bytes(rad, *k) for k in KEYS)
    with pytest.raises(HostPoolError, match="row of 8192 bytes: must be a multiple of 4096 holding the 12288"):
        HostPool.create(rad, KEYS, row_bytes=8192, pin=False)


def test_more_experts_than_host_pool_mib_allows_are_refused(rad):
    with pytest.raises(HostPoolError, match=r"48 experts x 0.01 MiB = 0.56 MiB do not fit --host-pool-mib 0 "
                                            r"\(it holds 42\)"):
        HostPool.create(rad, ALL, capacity_bytes=(1 << 19), pin=False)


def test_a_corrupt_model_file_fails_the_fill_naming_the_expert(rad, tmp_path):
    copy = tmp_path / "bad.rad"
    shutil.copy(rad.path, copy)
    e = rad.expert_entry(1, 7)
    with open(copy, "r+b") as f:
        f.seek(e.offset + 10)
        f.write(b"\xff\xff")
    with RadFile.open(copy) as bad:
        with pytest.raises(HostPoolError, match=rf"cannot fill the host pool: {copy}: expert \(layer 1, expert 7\) "
                                                rf"at offset {e.offset}: checksum mismatch"):
            HostPool.create(bad, KEYS, pin=False)


def test_an_empty_pool_allocates_nothing(rad):
    pool = HostPool.create(rad, [], pin=False)
    assert len(pool) == 0 and pool.tensor.shape[0] == 0 and pool.line() == "host pool: empty"


def test_a_tmpfs_pool_is_filled_once_and_mapped_again(rad, expert_bytes, shm_dir):
    first = HostPool.create(rad, KEYS, ram_dir=shm_dir, pin=False)
    second = HostPool.create(rad, KEYS, ram_dir=shm_dir, pin=False)
    assert first.filled_here and not second.filled_here and second.fill is None
    assert first.path == second.path and first.path.parent == shm_dir
    assert os.stat(first.path).st_size == 5 * ROW and os.stat(first.path).st_blocks * 512 == 5 * ROW
    assert first.path.with_name(first.path.name + ".ready").exists()
    assert all(as_bytes(second.row(*k)) == expert_bytes(rad, *k) for k in KEYS)
    first.row(0, 3)[0] = 7.0  # one shared copy: a write through one mapping shows in the other
    assert second.row(0, 3)[0] == 7.0
    assert "filled by another process, mapped as is" in second.line()
    other = HostPool.create(rad, KEYS[:2], ram_dir=shm_dir, pin=False)  # another layout: its own file
    assert other.path != first.path and other.filled_here


def test_a_damaged_ready_marker_means_fill_again(rad, expert_bytes, shm_dir):
    first = HostPool.create(rad, KEYS, ram_dir=shm_dir, pin=False)
    old_inode = os.stat(first.path).st_ino
    marker = first.path.with_name(first.path.name + ".ready")
    marker.write_bytes(b"{not json")
    again = HostPool.create(rad, KEYS, ram_dir=shm_dir, pin=False)
    assert again.filled_here and again.path == first.path
    assert os.stat(again.path).st_ino != old_inode  # a new file; the old one lives on while mapped
    assert all(as_bytes(again.row(*k)) == expert_bytes(rad, *k) for k in KEYS)
    assert all(as_bytes(first.row(*k)) == expert_bytes(rad, *k) for k in KEYS)  # the old mapping still reads


def test_a_failed_tmpfs_fill_leaves_no_pool_behind(rad, tmp_path, shm_dir):
    copy = tmp_path / "bad.rad"
    shutil.copy(rad.path, copy)
    with open(copy, "r+b") as f:
        f.seek(rad.expert_entry(2, 15).offset)
        f.write(b"\0\1\2")
    with RadFile.open(copy) as bad:
        with pytest.raises(HostPoolError, match=r"expert \(layer 2, expert 15\) .* checksum mismatch"):
            HostPool.create(bad, KEYS, ram_dir=shm_dir, pin=False)
    assert [p.suffix for p in shm_dir.iterdir()] == [".lock"]  # no pool file, no ready marker


def test_a_folder_that_is_not_tmpfs_is_refused(rad, tmp_path):
    with pytest.raises(HostPoolError, match=rf"ram={tmp_path}: not a tmpfs .* use a folder under /dev/shm"):
        HostPool.create(rad, KEYS, ram_dir=tmp_path, pin=False)


def test_a_tmpfs_too_small_fails_at_start_with_a_message(rad, tmp_path):
    """A real 256 KiB tmpfs (mounted here; the tests run as root) cannot take 48 x 12 KiB."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root?)")
    try:
        with pytest.raises(HostPoolError) as e:
            HostPool.create(rad, ALL, ram_dir=mnt, pin=False)
        assert str(e.value) == (f"ram={mnt}: the tmpfs has 0.25 MiB free but the host expert pool needs 0.56 MiB; "
                                f"grow the tmpfs (mount -o remount,size=...), free space in it, or lower "
                                f"--host-pool-mib")
        assert [p.name for p in mnt.iterdir() if not p.name.endswith(".lock")] == []  # nothing half-made left
        small = HostPool.create(rad, KEYS, ram_dir=mnt, pin=False)  # what fits still works
        assert small.filled_here
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


# -- two processes ----------------------------------------------------------------


def _mapping_kib(path: Path) -> tuple[int, int]:
    """(Rss, Pss) in KiB of this process's mapping of `path`, from /proc/self/smaps."""
    rss = pss = 0
    inside = False
    for line in open("/proc/self/smaps"):
        first = line.split()[0] if line.strip() else ""
        if "-" in first and ":" not in first:  # a mapping header: "addr-addr perms offset dev inode path"
            inside = line.rstrip().endswith(str(path))
        elif inside and first == "Rss:":
            rss += int(line.split()[1])
        elif inside and first == "Pss:":
            pss += int(line.split()[1])
    return rss, pss


def _child(rad_path: str, keys, folder: str, start, mapped, done, out) -> None:
    torch.set_num_threads(1)
    with RadFile.open(rad_path) as rad:
        start.wait()  # both processes start together
        pool = HostPool.create(rad, keys, ram_dir=folder, pin=False)
        digest = xxhash.xxh3_64_intdigest(as_bytes(pool.tensor))  # touches every page of the mapping
        mapped.wait()  # both hold the mapping now
        rss, pss = _mapping_kib(pool.path)
        out.put(dict(pid=os.getpid(), inode=os.stat(pool.path).st_ino, filled=pool.filled_here, digest=digest,
                     rss=rss, pss=pss, path=str(pool.path)))
        done.wait()


def test_two_processes_share_one_tmpfs_copy(rad, shm_dir):
    """Two daemons' worth of start-up: one fills, the other maps the same inode; the tmpfs holds one copy
    (allocated blocks = pool size) and each process is charged half of it (Pss)."""
    ctx = multiprocessing.get_context("spawn")
    start, mapped, done = ctx.Barrier(2), ctx.Barrier(2), ctx.Barrier(3)
    out = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(str(rad.path), ALL, str(shm_dir), start, mapped, done, out))
             for _ in range(2)]
    for p in procs:
        p.start()
    try:
        a, b = out.get(timeout=60), out.get(timeout=60)
        done.wait(timeout=60)
    finally:
        for p in procs:
            p.join(timeout=30)
    assert [p.exitcode for p in procs] == [0, 0]
    size = len(ALL) * ROW
    assert a["path"] == b["path"] and a["inode"] == b["inode"]
    assert sorted([a["filled"], b["filled"]]) == [False, True]  # filled once
    assert a["digest"] == b["digest"]
    assert os.stat(a["path"]).st_blocks * 512 == size  # the tmpfs holds one copy, not two
    for r in (a, b):
        assert r["rss"] == size // 1024  # each maps all of it ...
        assert abs(r["pss"] - size // 2048) <= 4  # ... and is charged half: the pages are shared
