"""One contract, every backend: a local directory, zarr's MemoryStore (through
ZarrStoreBackend) and an fsspec ``memory://`` URL pass the backend contract
dstt ships (:class:`dstt.testing.backends.BackendTests`: every operation dstt
uses), and a whole store -- save, read, prune, gc, verify --
works on the non-local ones too (they had two tests before)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import dstt
from dstt.format.backends import Backend, LocalBackend, ZarrStoreBackend, open_backend
from dstt.testing.backends import BackendTests


def _memory_url() -> str:
    return f"memory://dstt-contract-{uuid.uuid4().hex}"


class TestLocalBackend(BackendTests):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> Iterator[Backend]:
        b = LocalBackend(tmp_path / "store", create=True)
        yield b
        b.close()


class TestZarrMemoryStore(BackendTests):
    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        from zarr.storage import MemoryStore

        b = open_backend(MemoryStore())
        assert isinstance(b, ZarrStoreBackend)
        yield b
        b.close()


class TestFsspecMemory(BackendTests):
    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        pytest.importorskip("fsspec")
        b = open_backend(_memory_url(), create=True)
        yield b
        b.close()


@pytest.mark.parametrize("kind", ["local", "zarr-memory", "fsspec-memory"])
def test_file_capabilities_are_the_local_backends(kind: str, tmp_path: Path) -> None:
    """flock and real directories: a local directory's, no other backend's."""
    if kind == "local":
        b: Backend = LocalBackend(tmp_path / "store", create=True)
    elif kind == "zarr-memory":
        from zarr.storage import MemoryStore

        b = open_backend(MemoryStore())
    else:
        pytest.importorskip("fsspec")
        b = open_backend(_memory_url(), create=True)
    assert isinstance(b, LocalBackend) == b.flock == b.directories
    b.close()


def test_the_contract_suite_fails_a_backend_that_breaks_it(tmp_path: Path) -> None:
    """The shipped suite is not vacuous: a backend whose put_if_absent
    overwrites, or that says it can group syncs and cannot rename, fails it."""

    class Overwrites(LocalBackend):
        def put_if_absent(self, key: str, data: Any) -> bool:
            self.put(key, data)
            return True

    class Boasts(LocalBackend):
        group_sync = True

        def rename(self, src: str, dst: str) -> None:
            raise NotImplementedError

    suite = BackendTests()
    with pytest.raises(AssertionError):
        suite.test_atomic_put_and_put_if_absent(Overwrites(tmp_path / "a", create=True))
    with pytest.raises(NotImplementedError):
        suite.test_rename_where_it_says_it_can_group_syncs(Boasts(tmp_path / "b", create=True))


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
