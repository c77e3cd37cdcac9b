"""Object stores and other fsspec filesystems (``s3://``, ``gs://``,
``memory://``, ...), spoken to through fsspec directly.

Three things dstt needs from an object store that a generic zarr store does
not give it (docs/object-stores.md):

* **An atomic conditional create.** :meth:`FsspecBackend.put_if_absent` is a
  single request that the store refuses when the key exists (S3's
  ``If-None-Match: *``, fsspec's ``pipe_file(mode="create")``), so two racing
  writers can never both create a branch lock or claim the same branch id.
  zarr's ``set_if_not_exists`` is "check, then put" -- both racers win.
  Whether a store honours the condition is checked once per filesystem, the
  first time a lock is taken (:meth:`FsspecBackend.check_atomic_create`): a
  store that ignores it is refused at lock time with a one-line error.
* **No listing cache.** s3fs keeps every directory listing for the life of the
  process unless told otherwise; a long-lived writer would then miss steps
  another process committed, or reuse a slot. Every filesystem is opened with
  ``use_listings_cache=False`` and listings are never served from memory.
* **Parallel reads.** :meth:`FsspecBackend.get_many` fetches many small
  objects in one batch of concurrent requests (listing a 1,000-step run reads
  1,000 commit records).

Credentials and endpoints come from the usual places (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ``~/.aws``...) or from
``storage_options``, passed to fsspec unchanged.

>>> b = FsspecBackend("memory://dstt-doc-objectstore")
>>> b.put_if_absent("meta/x", b"1"), b.put_if_absent("meta/x", b"2"), b.get("meta/x")
(True, False, b'1')
>>> b.get_many(["meta/x", "meta/missing"])
[b'1', None]
"""

from __future__ import annotations

import threading
import uuid
from typing import Any, Mapping, Sequence

from dstt.errors import CorruptStoreError, StoreLockedError, StoreNotFoundError
from dstt.format.backends.base import Backend, Bytes, Data, check_key, join_data

#: Concurrent requests per batch in :meth:`FsspecBackend.get_many`.
READ_BATCH = 64

# memory:// lives in this process only: a lock makes its check-then-create
# atomic for every thread that can see it.
_MEMORY_CREATE_LOCK = threading.Lock()
# Per filesystem instance (fsspec shares instances per set of options):
# does its conditional create really refuse an existing key?
_ATOMIC_CHECKED: dict[Any, bool] = {}
_ATOMIC_LOCK = threading.Lock()


def _is_conflict(e: BaseException) -> bool:
    """S3 answers 409 ConditionalRequestConflict to the loser of two
    concurrent conditional writes: the key is being created by someone else."""
    import errno

    text = str(e)
    return (getattr(e, "errno", None) == errno.EBUSY or "ConditionalRequestConflict" in text
            or "conflicting conditional" in text.lower())


class FsspecBackend(Backend):
    """A store on any fsspec filesystem; puts are atomic per object.

    ``storage_options`` go to fsspec (``endpoint_url``, ``key``, ``secret``,
    ``client_kwargs``, ...); ``use_listings_cache`` is always turned off.
    """

    durable_sync = False  # a put is durable when it returns
    flock = False
    atomic_create = True
    can_readinto = False
    directories = False

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        try:
            from fsspec.core import url_to_fs
        except ImportError:  # pragma: no cover - fsspec comes with zarr
            raise StoreNotFoundError(f"cannot open {url!r}: fsspec is not installed") from None
        opts = dict(storage_options or {})
        #: As given (what a scan's worker process needs to open the store again).
        self.storage_options: dict[str, Any] = dict(opts)
        # Invariant: no listing is ever served from a cache (see module docstring).
        opts["use_listings_cache"] = False
        try:
            self.fs, root = url_to_fs(url, **opts)
        except ImportError as e:
            raise StoreNotFoundError(f"cannot open store URL {url!r}: {e} "
                                     f"(install the filesystem's package, e.g. pip install 'dstt[s3]')") from None
        except (ValueError, TypeError) as e:
            raise StoreNotFoundError(f"cannot open store URL {url!r}: {e}") from None
        self.url = url.rstrip("/")
        self.root = root.rstrip("/")
        protocol = self.fs.protocol
        self.protocol = protocol[0] if isinstance(protocol, (tuple, list)) else str(protocol)
        #: Conditional create is one request the store itself arbitrates
        #: (memory://: under a process-wide lock). Verified at lock time.
        self.atomic_create = True
        # s3fs first HEADs an object read whole, to split big ones into
        # concurrent ranges (above its 50 MiB block size); one GET is enough.
        self._cat_kw: dict[str, Any] = {"max_concurrency": 1} if self.protocol in ("s3", "s3a") else {}
        self._prefetched: dict[str, bytes] = {}
        self._prefetch_lock = threading.Lock()

    # -- helpers
    def _p(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}" if self.root else check_key(key)

    def _rel(self, path: str, base: str) -> str:
        path = path.rstrip("/")
        return path[len(base) + 1:] if path.startswith(base + "/") else path

    # -- interface
    def put(self, key: str, data: Data) -> None:
        self._take_prefetched(key)
        self.fs.pipe_file(self._p(key), join_data(data))

    def put_atomic(self, key: str, data: Bytes) -> None:
        self.put(key, data)  # one PUT: readers see the old or the new object

    def put_if_absent(self, key: str, data: Bytes) -> bool:
        path = self._p(key)
        if self.protocol == "memory":
            with _MEMORY_CREATE_LOCK:
                if self.fs.exists(path):
                    return False
                self.fs.pipe_file(path, bytes(data))
                return True
        try:
            self.fs.pipe_file(path, bytes(data), mode="create")
            return True
        except FileExistsError:
            return False
        except OSError as e:
            if _is_conflict(e):
                return False
            raise

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        """The object's bytes; one longer than ``max_bytes`` (when given) is
        refused with CorruptStoreError after reading at most one byte more."""
        path = self._p(key)
        early = self._take_prefetched(key)
        if early is not None:
            if max_bytes is not None and len(early) > max_bytes:
                raise CorruptStoreError(f"refusing {key!r}: more than the {max_bytes} bytes it can hold")
            return early
        try:
            if max_bytes is None:
                return bytes(self.fs.cat_file(path, **self._cat_kw))
            data = bytes(self.fs.cat_file(path, start=0, end=max_bytes + 1))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        if len(data) > max_bytes:
            raise CorruptStoreError(f"refusing {key!r}: more than the {max_bytes} bytes it can hold")
        return data

    def get_many(self, keys: Sequence[str], *, max_bytes: int | None = None) -> list[bytes | None]:
        """The values of ``keys`` (None where missing), fetched concurrently
        (batches of :data:`READ_BATCH` requests); each bounded like :meth:`get`."""
        if not keys:
            return []
        if not getattr(self.fs, "async_impl", False):
            return [self.get(k, max_bytes=max_bytes) for k in keys]
        paths = [self._p(k) for k in keys]
        # cat_ranges: one GET per key (fs.cat would first HEAD each path).
        values = self.fs.cat_ranges(paths, [None] * len(paths),
                                    [None if max_bytes is None else max_bytes + 1] * len(paths),
                                    on_error="return", batch_size=READ_BATCH, **self._cat_kw)
        out: list[bytes | None] = []
        for key, v in zip(keys, values):
            if isinstance(v, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
                out.append(None)
            elif isinstance(v, BaseException):
                raise v
            elif max_bytes is not None and len(v) > max_bytes:
                raise CorruptStoreError(f"refusing {key!r}: more than the {max_bytes} bytes it can hold")
            else:
                out.append(bytes(v))
        return out

    def prefetch(self, keys: Sequence[str], *, max_total_bytes: int = 256 << 20) -> None:
        """Fetch ``keys`` concurrently now; each is handed to the next
        :meth:`get` of that key, once (then forgotten: nothing is served
        twice, so nothing goes stale). For readers that know what they will
        read next (verify: a step's chunks). Missing keys are not kept."""
        keys = [k for k in dict.fromkeys(keys) if k not in self._prefetched]
        if not keys:
            return
        got = self.get_many(keys)
        with self._prefetch_lock:
            total = sum(len(v) for v in self._prefetched.values())
            for k, v in zip(keys, got):
                if v is not None and total + len(v) <= max_total_bytes:
                    self._prefetched[k] = v
                    total += len(v)

    def _take_prefetched(self, key: str) -> bytes | None:
        if not self._prefetched:
            return None
        with self._prefetch_lock:
            return self._prefetched.pop(key, None)

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        try:
            return bytes(self.fs.cat_file(self._p(key), start=start, end=start + length))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def _info(self, key: str) -> dict[str, Any] | None:
        try:
            info = self.fs.info(self._p(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return info if info.get("type") == "file" else None

    def exists(self, key: str) -> bool:
        return self._info(key) is not None

    def size(self, key: str) -> int | None:
        info = self._info(key)
        return None if info is None else int(info.get("size") or 0)

    def list_dir(self, prefix: str) -> list[str]:
        prefix = prefix.strip("/")
        base = f"{self.root}/{prefix}" if prefix else self.root
        if prefix:
            check_key(prefix)
        try:
            names = self.fs.ls(base, detail=False, refresh=True) if self.protocol == "s3" else self.fs.ls(base, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = {self._rel(n, base) for n in names}
        return sorted(n for n in out if n and "/" not in n and n != base)

    def list_prefix(self, prefix: str) -> list[str]:
        prefix = prefix.strip("/")
        base = f"{self.root}/{prefix}" if prefix else self.root
        try:
            found = self.fs.find(base, withdirs=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(self._rel(p, self.root) for p in found if p.rstrip("/") != base or not prefix)

    def delete(self, key: str) -> None:
        self._take_prefetched(key)
        try:
            self.fs.rm_file(self._p(key))
        except FileNotFoundError:
            pass

    def delete_prefix(self, prefix: str) -> None:
        keys = self.list_prefix(check_key(prefix.strip("/")))
        if not keys:
            return
        try:
            self.fs.rm([self._p(k) for k in keys])
        except FileNotFoundError:
            pass

    def put_if_unchanged(self, key: str, expected: bytes, data: Bytes) -> bool:
        """Replace ``key`` only if it still holds ``expected`` (one conditional
        request on S3: ``If-Match`` on the ETag read with it); True if replaced.
        What a lease takeover needs: of two writers replacing the same expired
        lease, one wins."""
        path = self._p(key)
        if self.protocol == "memory":
            with _MEMORY_CREATE_LOCK:
                if self.get(key) != expected:
                    return False
                self.fs.pipe_file(path, bytes(data))
                return True
        if self.protocol != "s3":
            raise StoreLockedError(f"{self.url}: cannot replace an object conditionally on this store")
        try:
            info = self.fs.info(path)
            etag = info.get("ETag") or info.get("etag")
            if etag is None or self.get(key) != expected:
                return False
            # The content read may be newer than the ETag: then If-Match fails (safe).
            self.fs.pipe_file(path, bytes(data), IfMatch=etag)
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            if _is_conflict(e) or "PreconditionFailed" in str(e) or "At least one of the pre-conditions" in str(e):
                return False
            raise

    # -- lock support
    def check_atomic_create(self) -> None:
        """Make sure this store refuses a conditional create of an existing
        key (checked once per filesystem); StoreLockedError if it does not,
        since a branch lock on it could be taken twice."""
        if self.protocol == "memory":
            return
        with _ATOMIC_LOCK:
            token = getattr(self.fs, "_fs_token", None) or id(self.fs)
            ok = _ATOMIC_CHECKED.get(token)
            if ok is None:
                probe = f"meta/locks/.create-probe-{uuid.uuid4().hex}"
                try:
                    first = self.put_if_absent(probe, b"probe")
                    second = self.put_if_absent(probe, b"probe")
                    ok = first and not second
                except Exception as e:  # noqa: BLE001 - e.g. an fsspec too old for mode="create"
                    raise StoreLockedError(
                        f"{self.url}: cannot create an object conditionally on this store "
                        f"({type(e).__name__}: {str(e)[:200]}); dstt needs fsspec/s3fs >= 2025.3") from None
                finally:
                    self.delete(probe)
                _ATOMIC_CHECKED[token] = ok
        if not ok:
            self.atomic_create = False
            raise StoreLockedError(
                f"{self.url}: this store does not refuse a conditional create of an existing object "
                f"(S3 'If-None-Match: *'), so two writers could both take a branch lock; "
                f"use a store that supports it (AWS S3, recent MinIO) or a local path")


__all__ = ["FsspecBackend", "READ_BATCH"]
