"""Any zarr-python store (``memory://``, fsspec URLs such as ``s3://``).
Object stores make a put durable and atomic when it returns, so ``sync()``
has nothing to do. zarr is imported only when such a store is opened.
"""

from __future__ import annotations

from typing import Any

from dstt.errors import CorruptStoreError
from dstt.format.backends.base import Backend, Bytes, Data, check_key, join_data


class ZarrStoreBackend(Backend):
    """Any zarr-python store (memory, fsspec URLs); puts are atomic per object."""

    def __init__(self, store: Any, url: str = "") -> None:
        from zarr.core.buffer import default_buffer_prototype

        self.store = store
        self.url = url or repr(store)
        self._proto = default_buffer_prototype()
        # zarr's MemoryStore creates with dict.setdefault (one atomic step, in
        # this process); other zarr stores check, then put (lock.py warns).
        self.atomic_create = type(store).__name__ == "MemoryStore"

    def _run(self, coro: Any) -> Any:
        from zarr.core.sync import sync

        return sync(coro)

    def _buf(self, data: Data) -> Any:
        return self._proto.buffer.from_bytes(join_data(data))

    def put(self, key: str, data: Data) -> None:
        self._run(self.store.set(check_key(key), self._buf(data)))

    def put_atomic(self, key: str, data: Bytes) -> None:
        self.put(key, data)

    def put_if_absent(self, key: str, data: Bytes) -> bool:
        check_key(key)
        self._run(self.store.set_if_not_exists(key, self._buf(data)))
        return self.get(key) == join_data(data)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        if max_bytes is None:
            buf = self._run(self.store.get(check_key(key), self._proto))
            return None if buf is None else buf.to_bytes()
        data = self.get_range(key, 0, max_bytes + 1)  # one byte more shows a longer value
        if data is not None and len(data) > max_bytes:
            raise CorruptStoreError(f"refusing {key!r}: more than the {max_bytes} bytes it can hold")
        return data

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        from zarr.abc.store import RangeByteRequest

        req = RangeByteRequest(start, start + length)
        buf = self._run(self.store.get(check_key(key), self._proto, byte_range=req))
        return None if buf is None else buf.to_bytes()

    def exists(self, key: str) -> bool:
        return bool(self._run(self.store.exists(check_key(key))))

    def list_dir(self, prefix: str) -> list[str]:
        prefix = prefix.strip("/")

        async def _collect() -> list[str]:
            return [x async for x in self.store.list_dir(prefix)]

        return sorted(n.rstrip("/") for n in self._run(_collect()))

    def list_prefix(self, prefix: str) -> list[str]:
        # Below the directory ``prefix`` only: zarr's list_prefix is a plain
        # string prefix, so "meta/steps/main" would also list (and
        # delete_prefix delete) the steps of a branch "main2".
        prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""

        async def _collect() -> list[str]:
            return [x async for x in self.store.list_prefix(prefix)]

        return sorted(self._run(_collect()))

    def delete(self, key: str) -> None:
        self._run(self.store.delete(check_key(key)))

    def delete_prefix(self, prefix: str) -> None:
        for key in self.list_prefix(prefix):
            self.delete(key)
