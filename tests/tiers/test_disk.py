"""The io_uring O_DIRECT reader on a real `.rad`: bytes, faults, and a loop that stays responsive."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import time

import pytest

from radianced.model.rad import RadFile
from radianced.tiers.aligned import ALIGN, aligned_buffer, buffer_address
from radianced.tiers.disk import DiskReader, ReadResult
from radianced.tiers.faults import Faults

ALL = [(layer, e) for layer in range(3) for e in range(16)]
READ = 12288  # the 9216-byte extent rounded up to 4096


@pytest.fixture(scope="module")
def rad(tier_rad):
    with RadFile.open(tier_rad) as r:
        yield r


def buffers(n: int, size: int = READ) -> list[memoryview]:
    """n aligned destinations carved from one aligned allocation."""
    big = aligned_buffer(n * size)
    return [big[i * size:(i + 1) * size] for i in range(n)]


def test_reads_match_the_files_expert_bytes(rad, expert_bytes):
    keys = ALL[::-1]  # any order
    into = buffers(len(keys))
    with DiskReader.from_rad(rad) as reader:
        assert reader.read_size(0, 0) == READ
        results = reader.read_experts(keys, into)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    for key, buf, r in zip(keys, into, results):
        assert r.key == key and r.nbytes == 9216 and r.offset == rad.expert_entry(*key).offset
        assert bytes(buf[:9216]) == expert_bytes(rad, *key)


@pytest.mark.parametrize("depth", [1, 4, 64])
def test_any_number_in_flight_reads_every_expert(rad, expert_bytes, depth):
    keys = ALL + ALL[:10]  # more reads than the ring's depth, some experts twice
    into = buffers(len(keys))
    done: list[int] = []
    with DiskReader.from_rad(rad, depth=depth) as reader:
        results = reader.read_experts(keys, into, on_done=lambda i, r: done.append(i))
    assert sorted(done) == list(range(len(keys)))
    assert [r.key for r in results] == keys and all(r.ok for r in results)
    assert all(bytes(b[:9216]) == expert_bytes(rad, *k) for k, b in zip(keys, into))


def test_a_truncated_file_fails_only_the_experts_past_its_end(rad, expert_bytes, tmp_path):
    copy = tmp_path / "cut.rad"
    shutil.copy(rad.path, copy)
    cut = rad.expert_entry(1, 4).offset + 5000  # inside (1, 4)'s extent
    os.truncate(copy, cut)
    keys = [(0, 0), (1, 3), (1, 4), (1, 5), (2, 15)]
    with DiskReader.from_rad(rad, path=copy) as reader:
        results = reader.read_experts(keys, buffers(len(keys)))
    assert [r.ok for r in results] == [True, True, False, False, False]
    e = rad.expert_entry(1, 4)
    assert results[2].error == (f"{copy}: expert (layer 1, expert 4) at offset {e.offset}: short read, 5000 of "
                                f"9216 bytes (the file is {cut} bytes; is it truncated? Copy it again or re-run "
                                f"radiancectl convert)")
    assert "short read, 0 of 9216 bytes" in results[3].error


def test_an_injected_read_error_fails_that_expert_once(rad, expert_bytes):
    faults = Faults()
    faults.fail(1, 3, errno.EIO)
    keys = [(1, 2), (1, 3), (1, 4)]
    into = buffers(3)
    with DiskReader.from_rad(rad, faults=faults) as reader:
        first = reader.read_experts(keys, into)
        again = reader.read_experts(keys, into)
    off = rad.expert_entry(1, 3).offset
    assert first[1] == ReadResult((1, 3), off, 9216,
                                  f"{rad.path}: expert (layer 1, expert 3) at offset {off}: read failed: "
                                  f"Input/output error (EIO)")
    assert first[0].ok and first[2].ok
    assert all(r.ok for r in again)  # the fault fired once; the daemon reads on
    assert bytes(into[1][:9216]) == expert_bytes(rad, 1, 3)


def test_a_flipped_byte_fails_that_experts_checksum(rad, tmp_path):
    copy = tmp_path / "flip.rad"
    shutil.copy(rad.path, copy)
    e = rad.expert_entry(2, 5)
    with open(copy, "r+b") as f:
        f.seek(e.offset + 1234)
        b = f.read(1)
        f.seek(e.offset + 1234)
        f.write(bytes([b[0] ^ 1]))
    keys = [(2, 4), (2, 5), (2, 6)]
    with DiskReader.from_rad(rad, path=copy) as reader:
        results = reader.read_experts(keys, buffers(3))
    assert [r.ok for r in results] == [True, False, True]
    assert results[1].error.startswith(f"{copy}: expert (layer 2, expert 5) at offset {e.offset}: checksum mismatch")
    assert f"header says {e.checksum:016x}" in results[1].error
    with DiskReader.from_rad(rad, path=copy, verify=False) as reader:  # unchecked: the damage passes
        assert all(r.ok for r in reader.read_experts(keys, buffers(3)))


def test_bad_destinations_are_refused_before_any_read(rad):
    base = aligned_buffer(2 * READ)
    with DiskReader.from_rad(rad) as reader:
        with pytest.raises(ValueError, match="not 4096-byte aligned"):
            reader.read_experts([(0, 0)], [base[1:1 + READ]])
        with pytest.raises(ValueError, match="holds 8192 bytes; the read needs 12288"):
            reader.read_experts([(0, 0)], [base[:8192]])
        with pytest.raises(ValueError, match="read-only"):
            reader.read_experts([(0, 0)], [memoryview(bytes(READ))])
        with pytest.raises(ValueError, match=r"no routed expert \(layer 9, expert 0\)"):
            reader.read_experts([(9, 0)], [base[:READ]])
        with pytest.raises(ValueError, match="2 experts but 1 destinations"):
            reader.read_experts([(0, 0), (0, 1)], [base[:READ]])
        assert reader.read_experts([(0, 0)], [base[:READ]])[0].ok  # still usable


def test_raw_ranges_read_the_file(rad):
    buf = aligned_buffer(2 * ALIGN)
    with DiskReader(rad.path, {}) as reader:
        assert reader.read_ranges([(0, buf[:ALIGN]), (ALIGN, buf[ALIGN:])]) == [ALIGN, ALIGN]
    with open(rad.path, "rb") as f:
        assert bytes(buf) == f.read(2 * ALIGN)
    assert buffer_address(buf) % ALIGN == 0


def test_async_reads_match_the_blocking_ones(rad, expert_bytes):
    into = buffers(len(ALL))
    done: list[int] = []

    async def main():
        with DiskReader.from_rad(rad, depth=8) as reader:
            return await reader.read_experts_async(ALL, into, on_done=lambda i, r: done.append(i))

    results = asyncio.run(main())
    assert all(r.ok for r in results) and sorted(done) == list(range(len(ALL)))
    assert all(bytes(b[:9216]) == expert_bytes(rad, *k) for k, b in zip(ALL, into))


async def heartbeat(stop: asyncio.Event, gaps: list[float]) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0.01)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


@pytest.mark.parametrize("mode", ["thread", "loop"])
def test_the_loop_keeps_ticking_during_a_slow_read(rad, expert_bytes, mode):
    """Three reads each wait 0.3 s in the kernel (a linked timeout): a heartbeat every 10 ms keeps
    ticking while the reader waits, in a worker thread (eventfd + poll, GIL released) or on the loop."""
    keys = [(0, 1), (1, 1), (2, 1), (2, 2)]
    into = buffers(len(keys))
    faults = Faults()
    for k in keys[:3]:
        faults.delay(*k, 0.3)

    async def main():
        stop, gaps = asyncio.Event(), []
        beat = asyncio.create_task(heartbeat(stop, gaps))
        with DiskReader.from_rad(rad, faults=faults) as reader:
            t0 = time.perf_counter()
            if mode == "thread":
                results = await asyncio.to_thread(reader.read_experts, keys, into)
            else:
                results = await reader.read_experts_async(keys, into)
            elapsed = time.perf_counter() - t0
        stop.set()
        await beat
        return results, elapsed, gaps

    results, elapsed, gaps = asyncio.run(main())
    assert all(r.ok for r in results)
    assert all(bytes(b[:9216]) == expert_bytes(rad, *k) for k, b in zip(keys, into))
    assert elapsed >= 0.3  # the reads really were slow
    assert len(gaps) >= 20 and max(gaps) < 0.05, f"loop stalled: longest gap {max(gaps) * 1e3:.1f} ms"


def test_cancelling_an_async_read_waits_for_reads_in_flight(rad):
    keys = ALL[:6]
    into = buffers(len(keys))
    faults = Faults()
    faults.delay(0, 0, 0.2)

    async def main():
        with DiskReader.from_rad(rad, depth=2, faults=faults) as reader:
            task = asyncio.create_task(reader.read_experts_async(keys, into))
            await asyncio.sleep(0.05)
            task.cancel()
            t0 = time.perf_counter()
            with pytest.raises(asyncio.CancelledError):
                await task
            waited = time.perf_counter() - t0
            again = await reader.read_experts_async(keys, into)  # the reader is free again
        return waited, again

    waited, again = asyncio.run(main())
    assert waited >= 0.1  # the delayed read in flight was waited for, not abandoned
    assert all(r.ok for r in again)


def test_one_batch_at_a_time(rad):
    faults = Faults()
    faults.delay(0, 0, 0.2)
    into = buffers(2)

    async def main():
        with DiskReader.from_rad(rad, faults=faults) as reader:
            first = asyncio.create_task(reader.read_experts_async([(0, 0)], into[:1]))
            await asyncio.sleep(0.02)
            with pytest.raises(RuntimeError, match="already running a batch"):
                reader.read_experts([(0, 1)], into[1:])
            return await first

    assert asyncio.run(main())[0].ok


def test_a_file_that_is_not_there_is_refused_clearly(tmp_path):
    from radianced.tiers.disk import DiskError

    with pytest.raises(DiskError, match=r"none.rad: cannot open for O_DIRECT reads: No such file"):
        DiskReader(tmp_path / "none.rad", {})
