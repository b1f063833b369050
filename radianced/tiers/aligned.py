"""Aligned host memory for O_DIRECT reads: the alignment, aligned buffers, and the check of a destination.

O_DIRECT reads whole blocks into block-aligned memory, so every destination of
a disk read (`aligned_buffer`, a host pool's rows, the loader's pinned
staging) starts on an ALIGN boundary and holds a whole number of blocks;
`check_buffer` says which rule a destination breaks, before any read starts.
"""

from __future__ import annotations

import ctypes
import mmap

ALIGN = 4096  # O_DIRECT block and buffer alignment (the .rad's ALIGN)


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def aligned_buffer(nbytes: int) -> memoryview:
    """nbytes (rounded up to ALIGN) of page-aligned anonymous memory, zeroed, as a writable memoryview."""
    return memoryview(mmap.mmap(-1, max(ALIGN, align_up(nbytes))))


def buffer_address(buf: memoryview) -> int:
    """The address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def check_buffer(buf, size: int, what: str) -> memoryview:
    """A flat, writable, ALIGN-aligned byte view of `buf` holding at least `size` bytes; raises
    ValueError naming `what` and the rule it breaks."""
    mv = memoryview(buf)
    if mv.readonly:
        raise ValueError(f"{what} is read-only")
    if not mv.c_contiguous:
        raise ValueError(f"{what} is not contiguous")
    mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    if mv.nbytes < size:
        raise ValueError(f"{what} holds {mv.nbytes} bytes; the read needs {size} (the extent rounded up to "
                         f"{ALIGN})")
    if buffer_address(mv) % ALIGN:
        raise ValueError(f"{what} is not {ALIGN}-byte aligned (O_DIRECT): use aligned_buffer() or pool rows")
    return mv
