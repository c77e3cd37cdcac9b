"""Local chunk I/O (O_DIRECT prefix + buffered tail, or all buffered) and the
staging pool's block placement that makes the direct path possible."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dstt.capture.hostpool import ALIGN, PAGE, PAGE_BLOCK_BYTES, HostPool
from dstt.errors import CaptureError
from dstt.format.localio import DIRECT_ALIGN, DIRECT_MIN_BYTES, DirectState, address, direct_prefix, write_file


def direct_supported(directory: Path) -> bool:
    probe = directory / "probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError as e:
        assert e.errno == errno.EINVAL
        return False
    os.close(fd)
    probe.unlink()
    return hasattr(os, "O_DIRECT")


def aligned_bytes(n: int, seed: int) -> memoryview:
    """``n`` random bytes starting on a page boundary."""
    raw = torch.empty(n + PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE
    view = raw[skip: skip + n]
    view.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    out = memoryview(view.numpy()).cast("B")
    assert address(out) % DIRECT_ALIGN == 0
    return out


@pytest.mark.parametrize("size", [DIRECT_MIN_BYTES, DIRECT_MIN_BYTES + 1, 3 * DIRECT_MIN_BYTES + 4093])
def test_direct_prefix_and_buffered_tail_write_exact_bytes(tmp_path: Path, size: int) -> None:
    body = aligned_bytes(size, size)
    trailer = b"\x01\x02\x03\x04"
    state = DirectState()
    path = tmp_path / "chunk"
    write_file(str(path), [body, trailer], state)
    assert path.read_bytes() == bytes(body) + trailer
    assert state.ok is direct_supported(tmp_path)  # the direct path ran wherever it can
    # a second write replaces the file entirely (O_TRUNC on both paths)
    write_file(str(path), [body[: DIRECT_MIN_BYTES]], state)
    assert path.read_bytes() == bytes(body[: DIRECT_MIN_BYTES])


def test_unaligned_or_small_buffers_are_written_buffered(tmp_path: Path) -> None:
    body = aligned_bytes(2 * DIRECT_MIN_BYTES + 1, 7)
    assert direct_prefix([body[1:]]) == 0  # address off the page
    assert direct_prefix([body[: DIRECT_MIN_BYTES - DIRECT_ALIGN]]) == 0  # too small to pay off
    assert direct_prefix([body]) == 2 * DIRECT_MIN_BYTES
    state = DirectState()
    write_file(str(tmp_path / "a"), [body[1:], b"xy"], state)
    assert (tmp_path / "a").read_bytes() == bytes(body[1:]) + b"xy"
    assert state.ok is None  # never tried


def test_filesystem_without_o_direct_falls_back_and_remembers(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem that refuses O_DIRECT (EINVAL at open, like older tmpfs)."""
    real_open = os.open
    refused: list[str] = []

    def no_direct(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            refused.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", no_direct)
    body = aligned_bytes(2 * DIRECT_MIN_BYTES, 3)
    state = DirectState()
    for name in ("c1", "c2"):
        write_file(str(tmp_path / name), [body, b"tail"], state)
        assert (tmp_path / name).read_bytes() == bytes(body) + b"tail"
    assert state.ok is False
    assert len(refused) == (1 if hasattr(os, "O_DIRECT") else 0)  # refused once, then not retried


def test_direct_io_can_be_turned_off(tmp_path: Path) -> None:
    state = DirectState(enabled=False)
    body = aligned_bytes(DIRECT_MIN_BYTES, 1)
    write_file(str(tmp_path / "c"), [body], state)
    assert (tmp_path / "c").read_bytes() == bytes(body) and state.ok is False


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3 * PAGE_BLOCK_BYTES), st.floats(0, 1)), min_size=1, max_size=60))
def test_pool_blocks_never_overlap_and_are_aligned(ops: list[tuple[int, float]]) -> None:
    """Random allocations, with releases mostly oldest-first (as chunks are
    written) but sometimes out of order: live blocks are disjoint, inside the
    pool, 64-byte aligned, and page aligned when large and the pool was empty
    (page alignment is taken where it fits, never waited for)."""
    pool = HostPool(8 * PAGE_BLOCK_BYTES)
    base = pool.buffer.data_ptr()
    live: list[torch.Tensor] = []
    for n, r in ops:
        if live and r < 0.4:
            pool.release(live.pop(0 if r < 0.3 else int(r * 10) % len(live)))
        was_empty = not live
        try:
            t = pool.allocate(n, timeout=0.01)
        except CaptureError as e:
            assert "timed out" in str(e) and live  # full (or fragmented): a real caller waits
            continue
        start = t.data_ptr() - base
        assert 0 <= start and start + n <= pool.capacity
        assert t.data_ptr() % ALIGN == 0
        if was_empty and n >= PAGE_BLOCK_BYTES:
            assert t.data_ptr() % PAGE == 0
        for other in live:
            o = other.data_ptr() - base
            assert start + n <= o or o + other.numel() <= start, "live blocks overlap"
        live.append(t)
    for t in live:
        pool.release(t)
    assert pool.idle() and pool.in_use == 0


def test_a_pool_that_holds_a_chunk_never_refuses_it_for_alignment() -> None:
    """host_buffer_bytes == max_chunk_bytes is valid: the full chunk fits even
    where a page-aligned one would not."""
    pool = HostPool(100_000)
    t = pool.allocate(100_000, timeout=1)
    assert t.numel() == 100_000
    pool.release(t)
    small = pool.allocate(64)
    big = pool.try_allocate(99_000)  # a page-aligned place would not fit beside `small`; a 64-aligned one does
    assert big is not None and big.data_ptr() % ALIGN == 0
    pool.release(small)
    pool.release(big)
    assert pool.idle()


def test_aligned_buffers_go_straight_to_the_device_in_iov_max_batches(tmp_path: Path) -> None:
    """Issue 25: a gathered pack -- every buffer page-aligned and whole
    pages -- is written with O_DIRECT by writev, more buffers than one call
    takes included; the bytes back to back, exactly."""
    from dstt.format import localio

    whole = aligned_bytes((localio.IOV_MAX + 100) * PAGE, 11)
    parts = [whole[i * PAGE:(i + 1) * PAGE] for i in range(localio.IOV_MAX + 100)]
    assert localio.aligned(parts) and not localio.aligned([*parts, b"tail"])
    state = DirectState()
    write_file(str(tmp_path / "p"), parts, state)
    assert (tmp_path / "p").read_bytes() == bytes(whole)
    assert state.ok is direct_supported(tmp_path)


def test_a_short_aligned_write_is_finished_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writev that stops part-way -- off the alignment or on it -- leaves
    the rest to the following calls, buffered once off the alignment."""
    from dstt.format import localio

    if not direct_supported(tmp_path):
        pytest.skip("no O_DIRECT here")
    real = os.writev
    cuts = [3 * PAGE, 5 * PAGE + 100]  # an aligned short write, then one off the alignment

    def short(fd: int, bufs: list[memoryview]) -> int:
        if cuts:
            n = cuts.pop(0)
            left = n
            for b in bufs:
                take = min(left, len(b))
                if take:
                    written = os.write(fd, b[:take]) if take % PAGE == 0 else _buffered(fd, b[:take])
                    assert written == take
                left -= take
            return n
        return real(fd, bufs)

    def _buffered(fd: int, b: memoryview) -> int:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        return os.write(fd, b)

    monkeypatch.setattr(localio.os, "writev", short)
    whole = aligned_bytes(320 * PAGE, 12)  # (at least DIRECT_MIN_BYTES: the direct path)
    parts = [whole[i * 20 * PAGE:(i + 1) * 20 * PAGE] for i in range(16)]
    write_file(str(tmp_path / "p"), parts, DirectState())
    assert not cuts and (tmp_path / "p").read_bytes() == bytes(whole)
