"""The backend contract: what every :class:`~dstt.format.backends.Backend`
does, whatever holds its bytes -- the operations dstt uses, the untrusted
reads, and capabilities that are honest.

A backend outside dstt runs it by subclassing :class:`BackendTests` in its
own tests and giving the ``backend`` fixture: a new, empty store::

    import pytest
    from dstt.testing.backends import BackendTests

    class TestMyBackend(BackendTests):
        @pytest.fixture
        def backend(self, tmp_path):
            b = MyBackend(tmp_path / "store")
            yield b
            b.close()

Every test gets a fresh store. dstt runs it on its own backends
(``tests/format/test_backend_contract.py``, and on a real S3-compatible
server, ``tests/system/test_s3.py``).
"""

from __future__ import annotations

from typing import Iterator

import pytest

from dstt.errors import CorruptStoreError
from dstt.format.backends import Backend


def _get(backend: Backend, key: str) -> bytes | None:
    data = backend.get(key)
    return None if data is None else bytes(data)


class BackendTests:
    """The backend contract (module docstring). Subclass it, and override
    the ``backend`` fixture to yield a new, empty store."""

    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        raise NotImplementedError("a BackendTests subclass gives the backend fixture: a new, empty store")
        yield  # (a generator, like the fixtures that override it)

    # ------------------------------------------------------------------ bytes in, bytes out

    def test_put_get_exists_size(self, backend: Backend) -> None:
        assert backend.get("a/b/c.bin") is None and not backend.exists("a/b/c.bin")
        backend.put("a/b/c.bin", b"hello")
        assert _get(backend, "a/b/c.bin") == b"hello"
        assert backend.exists("a/b/c.bin") and backend.size("a/b/c.bin") == 5
        backend.put("a/b/c.bin", [b"ab", memoryview(b"cd")])  # several buffers, overwriting
        assert _get(backend, "a/b/c.bin") == b"abcd"
        assert bytes(backend.get_range("a/b/c.bin", 1, 2) or b"") == b"bc"
        assert backend.size("missing") is None and backend.get_range("missing", 0, 1) is None

    def test_prefixes_are_not_keys(self, backend: Backend) -> None:
        backend.put("a/c/d", b"x")
        assert not backend.exists("a") and not backend.exists("a/c") and backend.exists("a/c/d")

    def test_atomic_put_and_put_if_absent(self, backend: Backend) -> None:
        backend.put_atomic("d/doc.json", b"{}")
        backend.put_atomic("d/doc.json", b'{"v": 2}')
        assert _get(backend, "d/doc.json") == b'{"v": 2}'
        assert backend.put_if_absent("d/claim", b"me") is True
        assert backend.put_if_absent("d/claim", b"you") is False
        assert _get(backend, "d/claim") == b"me"

    def test_list_and_delete(self, backend: Backend) -> None:
        assert backend.list_dir("") == [] and backend.list_dir("nope") == []
        for k in ("t/x/c.0", "t/x/c.1", "t/y/c.0", "top"):
            backend.put(k, b"1")
        assert sorted(backend.list_dir("")) == ["t", "top"]
        assert backend.list_dir("t") == ["x", "y"]
        assert sorted(backend.list_dir("t/x")) == ["c.0", "c.1"]
        assert sorted(backend.list_prefix("t")) == ["t/x/c.0", "t/x/c.1", "t/y/c.0"]
        backend.delete("t/x/c.0")
        backend.delete("t/x/c.0")  # idempotent
        assert sorted(backend.list_prefix("t")) == ["t/x/c.1", "t/y/c.0"]
        backend.delete_prefix("t")
        assert backend.list_prefix("t") == [] and backend.exists("top")

    # ------------------------------------------------------------------ untrusted keys and sizes

    def test_unsafe_keys_refused(self, backend: Backend) -> None:
        for key in ("../x", "/abs", "a//b", "a/./b", ""):
            with pytest.raises(CorruptStoreError):
                backend.put(key, b"x")
        with pytest.raises(CorruptStoreError):
            backend.get("../escape")

    def test_a_value_longer_than_allowed_is_refused(self, backend: Backend) -> None:
        backend.put_atomic("a/c/d", b"x" * 10)
        with pytest.raises(CorruptStoreError):
            backend.get("a/c/d", max_bytes=9)
        assert _get_bounded(backend, "a/c/d", 10) == b"x" * 10

    # ------------------------------------------------------------------ capabilities

    def test_readinto_where_it_says_it_can(self, backend: Backend) -> None:
        if backend.can_readinto:
            backend.put("r", b"abcdef")
            a, b = bytearray(4), bytearray(2)
            assert backend.readinto("r", [memoryview(a), memoryview(b)]) == 6 and bytes(a + b) == b"abcdef"
        else:
            with pytest.raises(NotImplementedError):
                backend.readinto("r", memoryview(bytearray(1)))

    def test_rename_where_it_says_it_can_group_syncs(self, backend: Backend) -> None:
        backend.put("m/k.tmp", b"marker")
        if backend.group_sync:
            backend.put("m/k", b"old")
            backend.rename("m/k.tmp", "m/k")  # atomic, replacing; durable at the next sync
            backend.sync()
            assert _get(backend, "m/k") == b"marker" and not backend.exists("m/k.tmp")
        else:
            with pytest.raises(NotImplementedError):
                backend.rename("m/k.tmp", "m/k")

    def test_sync_is_always_callable(self, backend: Backend) -> None:
        backend.put("s", b"1")
        backend.sync()
        assert _get(backend, "s") == b"1"


def _get_bounded(backend: Backend, key: str, max_bytes: int) -> bytes | None:
    data = backend.get(key, max_bytes=max_bytes)
    return None if data is None else bytes(data)


__all__ = ["BackendTests"]
