"""Byte movers: a small key/value interface (:class:`Backend`, in
:mod:`~dstt.format.backends.base`) over a local directory
(:class:`LocalBackend`) or any zarr store (:class:`ZarrStoreBackend`).

Each backend says what it can do with capability flags (``durable_sync``,
``flock``, ``atomic_create``, ``readinto``, ``directories``, ``group_sync``); callers test
those, never the class. :func:`open_backend` turns a path, URL or zarr Store
into a backend.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Mapping

from dstt.errors import StoreNotFoundError
from dstt.format.backends.base import Backend, Bytes, Data, check_key, join_data
from dstt.format.backends.local import LocalBackend
from dstt.format.backends.zarr_store import ZarrStoreBackend

__all__ = [
    "Backend",
    "Bytes",
    "Data",
    "LocalBackend",
    "ZarrStoreBackend",
    "check_key",
    "join_data",
    "open_backend",
]


def open_backend(store: Any, *, create: bool = False, storage_options: Mapping[str, Any] | None = None) -> Backend:
    """Turn a path, URL, zarr Store or Backend into a Backend.

    ``create`` allows a missing local directory to be made (writers only).
    ``storage_options`` go to fsspec for URLs (``s3://``...; see
    :mod:`~dstt.format.backends.objectstore`); anything else refuses them.
    """
    if storage_options and not (isinstance(store, (str, os.PathLike)) and "://" in os.fspath(store)
                                and not os.fspath(store).startswith("file://")):
        from dstt.errors import ConfigError

        raise ConfigError("storage_options apply only to fsspec URLs (s3://, gs://, memory://, ...)")
    if isinstance(store, Backend):
        return store
    # A zarr Store object can only exist if zarr is imported; local paths never
    # import it (zarr's import alone costs ~0.6 s here).
    if "zarr" in sys.modules and not isinstance(store, (str, os.PathLike)):
        from zarr.abc.store import Store as ZarrStore
        from zarr.storage import LocalStore

        if isinstance(store, LocalStore):
            return LocalBackend(store.root, create=create)
        if isinstance(store, ZarrStore):
            return ZarrStoreBackend(store)
    if isinstance(store, (str, os.PathLike)):
        s = os.fspath(store)
        if s.startswith("file://"):
            return LocalBackend(s[len("file://"):], create=create)
        if "://" in s:
            obstore = _obstore_backend(s, storage_options)
            if obstore is not None:
                return obstore
            from dstt.format.backends.objectstore import FsspecBackend

            return FsspecBackend(s, storage_options)
        return LocalBackend(s, create=create)
    raise StoreNotFoundError(
        f"expected a store path, URL or zarr Store, got {type(store).__name__}"
    )


def _obstore_backend(url: str, storage_options: Mapping[str, Any] | None) -> Backend | None:
    """An obstore backend for ``s3://``, ``gs://``, ``az://`` URLs unless
    DSTT_OBJECT_CLIENT=fsspec, obstore is missing (then fsspec, unless
    obstore was asked for) or ``storage_options`` has no obstore spelling."""
    import importlib.util

    from dstt import knobs
    from dstt.format.backends.obstore_backend import SCHEMES, translate_options

    client = knobs.object_client()
    if client == "fsspec" or url.split("://", 1)[0] not in SCHEMES:
        return None
    if importlib.util.find_spec("obstore") is None:
        if client == "obstore":
            raise StoreNotFoundError(f"cannot open {url!r} with DSTT_OBJECT_CLIENT=obstore: "
                                     "obstore is not installed (pip install 'dstt[obstore]')")
        return None
    config = translate_options(storage_options)
    if config is None:
        return None
    from dstt.format.backends.obstore_backend import ObstoreBackend

    return ObstoreBackend(url, config, storage_options=storage_options)
