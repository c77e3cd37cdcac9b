"""A /dev/shm pool registered with CUDA in pieces: which copies must go
through a bounce buffer (the arithmetic; the copies themselves are in
tests/system/test_cuda.py, on a GPU)."""

from __future__ import annotations

import logging

import pytest
import torch

from dstt.capture import hostpool
from dstt.capture.hostpool import HostPool


def test_blocks_straddling_two_pieces_bounce_and_others_do_not(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(hostpool, "REGISTER_PIECE_BYTES", 64 << 10)
    raw = torch.empty((1 << 20) + hostpool.PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % hostpool.PAGE
    with caplog.at_level(logging.WARNING):
        pool = HostPool(1 << 20, pin=True, buffer=raw[skip:skip + (1 << 20)])
        assert pool.registered.wait(30)
    if not torch.cuda.is_available():
        assert not pool.pinned  # registration failed: copies stay pageable, said once
        assert any("register" in r.getMessage() for r in caplog.records)
    inside = pool.buffer[1000:1000 + 4096]
    straddling = pool.buffer[(64 << 10) - 8:(64 << 10) + 8]
    at_edge = pool.buffer[(64 << 10) - 16:64 << 10]
    assert pool.copy_mode(inside) == pool.copy_mode(at_edge) == ("pinned" if pool.pinned else "pageable")
    assert pool.copy_mode(straddling) == "bounce"
    assert pool.copy_mode(pool.buffer[70_000:70_000]) != "bounce"  # empty: nothing to copy
    pool.unregister()
    assert not pool.pinned and pool._pieces == []


def test_an_in_process_pool_is_never_split() -> None:
    pool = HostPool(1 << 20)
    assert pool.copy_mode(pool.buffer[(64 << 10) - 8:(64 << 10) + 8]) == "pageable"
