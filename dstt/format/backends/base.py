"""The backend interface: a small key/value byte store, and what each
implementation can do (capability flags), so callers branch on capabilities,
never on classes.

Storage plugins only move bytes; everything about the format lives elsewhere.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from dstt.errors import CorruptStoreError

Bytes = bytes | bytearray | memoryview
#: A value to put: one buffer, or several written back to back.
Data = Bytes | list[Bytes] | tuple[Bytes, ...]


def join_data(data: "Data") -> bytes:
    if isinstance(data, (list, tuple)):
        return b"".join(bytes(memoryview(d).cast("B")) for d in data)
    return bytes(data)


def check_key(key: str) -> str:
    """Refuse keys that could leave the store (hostile manifests included)."""
    if not isinstance(key, str) or not key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise CorruptStoreError(f"refusing unsafe store key {key!r}")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise CorruptStoreError(f"refusing unsafe store key {key!r}")
    return key


class Backend(ABC):
    """Minimal byte store used by dstt. Keys are '/'-separated and relative."""

    # Capabilities: what this backend can do. Callers test these flags, never
    # the backend's class.

    #: ``sync()`` really makes earlier puts durable (local disks). Without
    #: it, a put is durable when it returns (object stores) or never.
    durable_sync: bool = False
    #: Keys are local files that ``flock(2)`` can lock (a lock dies with its
    #: process); otherwise locks are lease files (see :mod:`dstt.format.lock`).
    flock: bool = False
    #: ``put_if_absent`` is atomic against every other writer of the store.
    atomic_create: bool = False
    #: ``readinto(key, buffers)`` reads a whole object into caller buffers.
    can_readinto: bool = False
    #: Keys are files in real directories: the store's root exists apart from
    #: its keys, and ``remove_empty_dirs(prefix)`` has empty ones to sweep.
    directories: bool = False
    #: One ``sync()`` makes every earlier put and ``rename`` of the store
    #: durable at once (``syncfs(2)``), and ``rename(src, dst)`` moves a key
    #: atomically: several steps can be committed with one round of syncs
    #: (:mod:`dstt.format.groupcommit`).
    group_sync: bool = False
    #: A human/URL description of where the store lives.
    url: str = ""

    @abstractmethod
    def put(self, key: str, data: Data) -> None:
        """Write ``data`` under ``key`` (overwriting). Durable only after sync()."""

    @abstractmethod
    def put_atomic(self, key: str, data: Bytes) -> None:
        """Write ``key`` so that readers see the old or the new value, never a
        mix, and the new value is durable when this returns."""

    @abstractmethod
    def put_if_absent(self, key: str, data: Bytes) -> bool:
        """Create ``key`` only if it does not exist; True if this call created it."""

    @abstractmethod
    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        """The value of ``key``, or None when it does not exist. A value
        longer than ``max_bytes`` (when given: what the format allows there)
        is refused with CorruptStoreError, without reading it whole: anything
        read from a store is untrusted."""

    @abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes | None: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list_dir(self, prefix: str) -> list[str]:
        """Names (files and sub-directories) directly below ``prefix``."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` if it exists."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Remove everything below ``prefix``."""

    def list_prefix(self, prefix: str) -> list[str]:
        """Every key below ``prefix`` (recursive), relative to the store root."""
        out: list[str] = []
        stack = [prefix.rstrip("/")]
        while stack:
            p = stack.pop()
            for name in self.list_dir(p):
                k = f"{p}/{name}" if p else name
                if self.exists(k):
                    out.append(k)
                else:
                    stack.append(k)
        return out

    def sync(self) -> None:
        """Make every put so far durable."""

    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` to ``dst`` atomically (replacing it); durable at the
        next :meth:`sync`. Only where ``group_sync``."""
        raise NotImplementedError(f"{type(self).__name__} cannot rename")

    def size(self, key: str) -> int | None:
        data = self.get(key)  # (backends that can, answer without reading)
        return None if data is None else len(data)

    def readinto(self, key: str, out: memoryview | list[memoryview]) -> int | None:
        """Read a whole object into ``out`` (one buffer, or several filled in
        order): the bytes read (one more than fits when the object is longer),
        or None if it is missing. Only where ``can_readinto``."""
        raise NotImplementedError(f"{type(self).__name__} cannot readinto")

    def remove_empty_dirs(self, prefix: str) -> None:
        """Remove empty directories below ``prefix`` (where ``directories``)."""

    def close(self) -> None:
        pass
