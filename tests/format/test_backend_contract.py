"""One contract, every backend: a local directory, zarr's MemoryStore (through
ZarrStoreBackend) and an fsspec ``memory://`` URL behave the same for every
operation dstt uses, and a whole store -- save, read, prune, gc, verify --
works on the non-local ones too (they had two tests before)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Iterator

import pytest
import torch

import dstt
from dstt.format.backends import Backend, LocalBackend, ZarrStoreBackend, open_backend


def _memory_url() -> str:
    return f"memory://dstt-contract-{uuid.uuid4().hex}"


@pytest.fixture(params=["local", "zarr-memory", "fsspec-memory"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "local":
        b: Backend = LocalBackend(tmp_path / "store", create=True)
    elif request.param == "zarr-memory":
        from zarr.storage import MemoryStore

        b = open_backend(MemoryStore())
        assert isinstance(b, ZarrStoreBackend)
    else:
        pytest.importorskip("fsspec")
        b = open_backend(_memory_url(), create=True)
    yield b
    b.close()


class TestBackendContract:
    def test_put_get_exists_size(self, backend: Backend) -> None:
        assert backend.get("a/b/c.bin") is None and not backend.exists("a/b/c.bin")
        backend.put("a/b/c.bin", b"hello")
        assert bytes(backend.get("a/b/c.bin") or b"") == b"hello"
        assert backend.exists("a/b/c.bin") and backend.size("a/b/c.bin") == 5
        backend.put("a/b/c.bin", [b"ab", memoryview(b"cd")])  # several buffers, overwriting
        assert bytes(backend.get("a/b/c.bin") or b"") == b"abcd"
        assert bytes(backend.get_range("a/b/c.bin", 1, 2) or b"") == b"bc"
        assert backend.size("missing") is None

    def test_atomic_put_and_put_if_absent(self, backend: Backend) -> None:
        backend.put_atomic("meta/doc.json", b"{}")
        backend.put_atomic("meta/doc.json", b'{"v": 2}')
        assert bytes(backend.get("meta/doc.json") or b"") == b'{"v": 2}'
        assert backend.put_if_absent("meta/claim", b"me") is True
        assert backend.put_if_absent("meta/claim", b"you") is False
        assert bytes(backend.get("meta/claim") or b"") == b"me"

    def test_list_and_delete(self, backend: Backend) -> None:
        for k in ("t/x/c.0", "t/x/c.1", "t/y/c.0", "top"):
            backend.put(k, b"1")
        assert backend.list_dir("t") == ["x", "y"]
        assert sorted(backend.list_dir("t/x")) == ["c.0", "c.1"]
        assert sorted(backend.list_prefix("t")) == ["t/x/c.0", "t/x/c.1", "t/y/c.0"]
        backend.delete("t/x/c.0")
        backend.delete("t/x/c.0")  # idempotent
        assert sorted(backend.list_prefix("t")) == ["t/x/c.1", "t/y/c.0"]
        backend.delete_prefix("t")
        assert backend.list_prefix("t") == [] and backend.exists("top")

    def test_unsafe_keys_refused(self, backend: Backend) -> None:
        for key in ("../x", "/abs", "a//b", "a/./b", ""):
            with pytest.raises(dstt.CorruptStoreError):
                backend.put(key, b"x")

    def test_capabilities_are_honest(self, backend: Backend) -> None:
        if backend.can_readinto:
            backend.put("r", b"abcdef")
            a, b = bytearray(4), bytearray(2)
            assert backend.readinto("r", [memoryview(a), memoryview(b)]) == 6 and bytes(a + b) == b"abcdef"
        else:
            with pytest.raises(NotImplementedError):
                backend.readinto("r", memoryview(bytearray(1)))
        assert isinstance(backend, LocalBackend) == backend.flock == backend.directories
        backend.sync()  # always callable


@pytest.fixture(params=["fsspec-memory", "zarr-memory"])
def remote_store(request: pytest.FixtureRequest) -> object:
    if request.param == "fsspec-memory":
        pytest.importorskip("fsspec")
        return _memory_url()
    from zarr.storage import MemoryStore

    return open_backend(MemoryStore())  # one object: a MemoryStore lives only as long as it


def test_store_lifecycle_on_memory_backends(remote_store: object) -> None:
    """save, read, branch, prune, gc and verify on non-local backends."""
    frozen = torch.arange(6.0)
    for s in range(5):
        dstt.save(remote_store, s, {"model": {"w": torch.full((3,), float(s))}, "frozen": frozen})
    dstt.save(remote_store, 10, {"model": {"w": torch.zeros(3)}, "frozen": frozen}, branch="side", parent="main:2")
    run = dstt.open(remote_store)
    assert run.steps() == [0, 1, 2, 3, 4] and run.branch_info("side").parent == ("main", 2)
    assert torch.equal(run.read("model/w", 3), torch.full((3,), 3.0))
    report = dstt.verify(remote_store)
    assert report.ok, report.problems

    pruned = dstt.prune(remote_store, keep_last=1)
    assert sorted(pruned.removed) == [("main", 0), ("main", 1), ("main", 3)]  # 2 is a fork point
    collected = dstt.gc(remote_store)
    assert collected.chunks_removed == 3  # model/w of steps 0, 1, 3; frozen is shared by all
    run = dstt.open(remote_store)
    assert run.steps() == [2, 4]
    assert torch.equal(run.read("frozen", 4), frozen) and torch.equal(run.read("model/w", 2), torch.full((3,), 2.0))
    assert torch.equal(run.read("model/w", 10, branch="side"), torch.zeros(3))
    assert dstt.verify(remote_store).ok
