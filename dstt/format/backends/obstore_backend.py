"""Object stores (``s3://``, ``gs://``, ``az://``) through obstore: the Rust
object_store crate that zarr-python itself offers as ``ObjectStore``.

The same contract as :class:`~dstt.format.backends.objectstore.FsspecBackend`
(docs/object-stores.md): an atomic conditional create (S3's
``If-None-Match: *``, obstore's ``mode="create"``; S3 is configured with
``conditional_put="etag"`` so creates and replaces are conditional
requests), no listing cache (obstore keeps none), concurrent batched reads.
What it saves is the import: ``import obstore`` costs a tenth of s3fs +
aiobotocore's (benchmarks/bench_s3.py).

Credentials and endpoints come from the usual variables (``AWS_*``,
``GOOGLE_*``, ``AZURE_*``) or from ``storage_options`` in fsspec's
spelling (``endpoint_url``, ``key``, ``secret``, ``client_kwargs.region_name``);
options it does not know make :func:`~dstt.format.backends.open_backend`
use fsspec instead.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Sequence

from dstt.errors import CorruptStoreError, StoreLockedError, StoreNotFoundError
from dstt.format.backends.base import Backend, Bytes, Data, check_key, join_data
from dstt.knobs import s3_endpoint

#: Concurrent requests per batch in :meth:`ObstoreBackend.get_many`.
READ_BATCH = 64
#: URL schemes served here.
SCHEMES = ("s3", "gs", "az", "abfs", "abfss")
#: fsspec storage_options understood (-> obstore S3 config keys).
_S3_OPTIONS = {"endpoint_url": "endpoint", "key": "access_key_id", "secret": "secret_access_key",
               "token": "session_token"}


def translate_options(storage_options: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """fsspec-style S3 ``storage_options`` as obstore config, or None when
    one of them has no obstore spelling (then fsspec serves the URL).

    >>> translate_options({"endpoint_url": "http://h:9000", "key": "k", "client_kwargs": {"region_name": "eu"}})
    {'endpoint': 'http://h:9000', 'access_key_id': 'k', 'region': 'eu'}
    >>> translate_options({"anon": True}) is None
    True
    """
    out: dict[str, Any] = {}
    for k, v in (storage_options or {}).items():
        if k in _S3_OPTIONS:
            out[_S3_OPTIONS[k]] = v
        elif k == "client_kwargs" and isinstance(v, Mapping) and set(v) <= {"region_name"}:
            if "region_name" in v:
                out["region"] = v["region_name"]
        elif k == "use_listings_cache":
            continue
        else:
            return None
    return out


class ObstoreBackend(Backend):
    """A store on S3, GCS or Azure through obstore; puts are atomic per object."""

    durable_sync = False  # a put is durable when it returns
    flock = False
    atomic_create = True
    can_readinto = False
    directories = False

    def __init__(self, url: str, config: Mapping[str, Any] | None = None, *,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        try:
            import obstore
            from obstore.store import from_url
        except ImportError:  # pragma: no cover - the caller checks
            raise StoreNotFoundError(f"cannot open {url!r}: obstore is not installed") from None
        self._obs = obstore
        self.url = url.rstrip("/")
        self.protocol = url.split("://", 1)[0]
        #: What it was opened with (fsspec's spelling): what a scan's tasks
        #: open it with in another process (dstt.format.scan.StoreSpec).
        self.storage_options: dict[str, Any] = dict(storage_options or {})
        cfg: dict[str, Any] = dict(config or {})
        client: dict[str, Any] = {}
        if self.protocol == "s3":
            cfg.setdefault("conditional_put", "etag")
            endpoint = str(cfg.get("endpoint") or s3_endpoint())
            if endpoint.startswith("http://"):
                client["allow_http"] = True
        try:
            self.store = from_url(self.url, config=cfg or None, client_options=client or None)  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - obstore's config errors: one line
            raise StoreNotFoundError(f"cannot open store URL {url!r}: {e}") from None
        self.root = ""

    # -- interface
    def put(self, key: str, data: Data) -> None:
        self._obs.put(self.store, check_key(key), join_data(data))

    def put_atomic(self, key: str, data: Bytes) -> None:
        self.put(key, data)  # one PUT: readers see the old or the new object

    def put_if_absent(self, key: str, data: Bytes) -> bool:
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        try:
            self._obs.put(self.store, check_key(key), bytes(data), mode="create")
            return True
        except (AlreadyExistsError, FileExistsError, PreconditionError):
            return False
        except Exception as e:  # S3's 409 ConditionalRequestConflict: someone else is creating it
            if "409" in str(e) or "ConditionalRequestConflict" in str(e):
                return False
            raise

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        """The object's bytes; one longer than ``max_bytes`` (when given) is
        refused with CorruptStoreError after reading at most one byte more."""
        from obstore.exceptions import NotFoundError

        if max_bytes is None:
            try:
                return bytes(self._obs.get(self.store, check_key(key)).bytes())
            except (NotFoundError, FileNotFoundError):
                return None
        try:
            data = bytes(self._obs.get(self.store, check_key(key),
                                       options={"range": (0, max_bytes + 1)}).bytes())
        except (NotFoundError, FileNotFoundError):
            return None
        except Exception as e:  # a range past the end of a small object: read it whole
            if "Range" not in str(e) and "range" not in str(e):
                raise
            try:
                data = bytes(self._obs.get(self.store, check_key(key)).bytes())
            except (NotFoundError, FileNotFoundError):
                return None
        if len(data) > max_bytes:
            raise CorruptStoreError(f"refusing {key!r}: more than the {max_bytes} bytes it can hold")
        return data

    def get_many(self, keys: Sequence[str], *, max_bytes: int | None = None) -> list[bytes | None]:
        """The values of ``keys`` (None where missing), fetched concurrently."""
        if len(keys) <= 1:
            return [self.get(k, max_bytes=max_bytes) for k in keys]
        with ThreadPoolExecutor(max_workers=min(READ_BATCH, len(keys)), thread_name_prefix="dstt-obs") as pool:
            return list(pool.map(lambda k: self.get(k, max_bytes=max_bytes), keys))

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        from obstore.exceptions import NotFoundError

        if length <= 0:
            return b"" if self.exists(key) else None
        try:
            return bytes(self._obs.get_range(self.store, check_key(key), start=start, length=length))
        except (NotFoundError, FileNotFoundError):
            return None

    def _head(self, key: str) -> dict[str, Any] | None:
        from obstore.exceptions import NotFoundError

        try:
            return dict(self._obs.head(self.store, check_key(key)))
        except (NotFoundError, FileNotFoundError):
            return None

    def exists(self, key: str) -> bool:
        return self._head(key) is not None

    def size(self, key: str) -> int | None:
        h = self._head(key)
        return None if h is None else int(h.get("size") or 0)

    def list_dir(self, prefix: str) -> list[str]:
        prefix = prefix.strip("/")
        if prefix:
            check_key(prefix)
        got = self._obs.list_with_delimiter(self.store, prefix or None)
        base = prefix + "/" if prefix else ""
        names = {p.rstrip("/")[len(base):] for p in got["common_prefixes"]}
        names |= {o["path"][len(base):] for o in got["objects"]}
        return sorted(n for n in names if n and "/" not in n)

    def list_prefix(self, prefix: str) -> list[str]:
        prefix = prefix.strip("/")
        out: list[str] = []
        for batch in self._obs.list(self.store, prefix or None, chunk_size=1000):
            out.extend(o["path"] for o in batch)
        return sorted(out)

    def delete(self, key: str) -> None:
        from obstore.exceptions import NotFoundError

        try:
            self._obs.delete(self.store, check_key(key))
        except (NotFoundError, FileNotFoundError):
            pass

    def delete_prefix(self, prefix: str) -> None:
        keys = self.list_prefix(check_key(prefix.strip("/")))
        for i in range(0, len(keys), 1000):
            self._obs.delete(self.store, keys[i:i + 1000])

    def put_if_unchanged(self, key: str, expected: bytes, data: Bytes) -> bool:
        """Replace ``key`` only if it still holds ``expected`` (``If-Match``
        on the ETag read with it); True if replaced."""
        from obstore.exceptions import NotFoundError, PreconditionError

        try:
            got = self._obs.get(self.store, check_key(key))
            etag = got.meta.get("e_tag")
            if etag is None or bytes(got.bytes()) != expected:
                return False
            self._obs.put(self.store, key, bytes(data), mode={"e_tag": etag})
            return True
        except (NotFoundError, FileNotFoundError, PreconditionError):
            return False
        except Exception as e:
            if "409" in str(e) or "412" in str(e) or "ConditionalRequestConflict" in str(e):
                return False
            raise

    # -- lock support
    def check_atomic_create(self) -> None:
        """Make sure this store refuses a conditional create of an existing
        key (checked once per backend); StoreLockedError if it does not."""
        if getattr(self, "_atomic_ok", None):
            return
        probe = f"meta/locks/.create-probe-{uuid.uuid4().hex}"
        try:
            first = self.put_if_absent(probe, b"probe")
            second = self.put_if_absent(probe, b"probe")
        except Exception as e:  # noqa: BLE001
            raise StoreLockedError(f"{self.url}: cannot create an object conditionally on this store "
                                   f"({type(e).__name__}: {str(e)[:200]})") from None
        finally:
            self.delete(probe)
        if not (first and not second):
            self.atomic_create = False
            raise StoreLockedError(
                f"{self.url}: this store does not refuse a conditional create of an existing object "
                f"(S3 'If-None-Match: *'), so two writers could both take a branch lock; "
                f"use a store that supports it (AWS S3, recent MinIO) or a local path")
        self._atomic_ok = True


__all__ = ["ObstoreBackend", "SCHEMES", "translate_options"]
