"""Whether a folder can back a `ram=DIR` placement: it exists and is a tmpfs. No torch.

`ram=DIR` puts pinned memory in a file in DIR so that daemons on one host map
one copy (SPEC §4 "tmpfs"); on any other file system the pages would be a
page-cache copy written back to disk, so such a folder is refused.
"""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path

TMPFS_MAGIC = 0x01021994  # statfs f_type of tmpfs and of /dev/shm


def fs_type(path: str | os.PathLike) -> int:
    """statfs(2)'s f_type (the first field of struct statfs on 64-bit Linux); OSError on failure."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on x86-64 and arm64
    if libc.statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return struct.unpack_from("l", buf)[0] & 0xFFFFFFFF


def tmpfs_refusal(folder: str | os.PathLike) -> str | None:
    """None when `folder` is a tmpfs folder, else why not, as `ram=DIR: ...; what to do`."""
    folder = Path(folder)
    if not folder.is_dir():
        return f"ram={folder}: no such folder; create it on a tmpfs (e.g. under /dev/shm)"
    try:
        fs = fs_type(folder)
    except OSError as e:
        return f"ram={folder}: statfs failed: {e.strerror}"
    if fs != TMPFS_MAGIC:
        return (f"ram={folder}: not a tmpfs (file system type {fs:#x}); the shared pool must live in RAM: "
                f"use a folder under /dev/shm or mount a tmpfs")
    return None
