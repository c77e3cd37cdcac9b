"""Opening a branch for writing (the writer's setup, store/writer.py).

:func:`open_branch` opens (rank 0: creates) the store, takes the branch
write lock (rank 0; a capture helper passes its trainer's, already held)
and creates the branch document, then shares the outcome with the other
ranks, so every rank fails alike. :func:`previous_links` reads the latest
committed step's index back, checked against its commit record, as the
chunks the writer's first step dedups (and codes) against.
"""

from __future__ import annotations

from typing import Any

from dstt.errors import ChecksumMismatchError, CorruptStoreError, DsttError, InvalidNameError, StepNotFoundError
from dstt.format import layout as L
from dstt.format.backends import Backend, open_backend
from dstt.format.codecs.keyframes import Link, resolved_tails
from dstt.format.index import resolve_parent
from dstt.format.lock import acquire as acquire_lock
from dstt.format.manifest import parse_commit, parse_index_checked, sha256_hex
from dstt.format.pygc import paused_gc
from dstt.format.root import create_branch, ensure_root, load_branch
from dstt.store.coord import Coordinator


def open_branch(store: Any, branch: str, parent: L.StepRef | str | None, coord: Coordinator, *,
                given_lock: Any = None, storage_options: dict[str, Any] | None = None) -> tuple[Backend, Any]:
    """The store's backend and the branch write lock this rank holds (rank
    0: ``given_lock`` or one taken here; other ranks: None). Rank 0 creates
    the store root and the branch (forked from ``parent``) if they are
    missing; its error, if any, is raised on every rank (broadcast under
    torch.distributed), the lock it took released."""
    error = None
    backend = None
    lock = None
    if coord.rank == 0:
        try:
            backend = open_backend(store, create=True, storage_options=storage_options)
            ensure_root(backend)
            lock = given_lock or acquire_lock(backend, branch)
            ensure_branch(backend, branch, resolve_parent(backend, parent))
        except DsttError as e:
            error = e
            if lock is not None:
                lock.release()
    if coord.distributed:
        error = coord.broadcast(error)
    if error is not None:
        raise error
    if backend is None:
        backend = open_backend(store, create=False, storage_options=storage_options)
    return backend, lock


def ensure_branch(backend: Backend, branch: str, parent: tuple[str, int] | None) -> None:
    """Create ``branch`` (forked from ``parent``) unless it exists; an
    existing branch with another parent is refused (InvalidNameError)."""
    if parent is not None:
        L.validate_step(parent[1], "parent step")
    if backend.exists(L.branch_key(branch)):
        info = load_branch(backend, branch)
        if parent is not None and info.parent != tuple(parent):
            raise InvalidNameError(
                f"branch {branch!r} already exists with parent {info.parent}; "
                f"cannot reuse it for parent {tuple(parent)}"
            )
        return
    if parent is not None:
        load_branch(backend, parent[0])  # an unknown parent branch, named as such
    create_branch(backend, branch, None if parent is None else (parent[0], L.validate_step(parent[1], "parent step")))


def _get(backend: Backend, key: str, max_bytes: int) -> bytes:
    data = backend.get(key, max_bytes=max_bytes)
    if data is None:
        raise StepNotFoundError(f"missing {key} in {backend.url}")
    return data


def previous_links(backend: Backend, branch: str, step: int, commit: dict[str, Any] | None = None,
                   ) -> tuple[dict[tuple[str, int], Link], set[str]]:
    """The chunks of ``step`` a new writer dedups against, read like readers
    read it: its index.json must match the size and sha256 its commit
    records (a damaged index would make every new step point at wrong
    slots). Returns each (array, chunk index)'s link and the arrays whose
    zarr.json exists."""
    where = L.step_dir(branch, step)
    if commit is None:
        commit = parse_commit(_get(backend, f"{where}/{L.COMMIT_FILE}", L.MAX_DOC_BYTES), where)
    rec = commit["files"][L.INDEX_FILE]
    try:
        data: bytes | None = _get(backend, f"{where}/{L.INDEX_FILE}", rec["size"])
    except CorruptStoreError:  # longer than recorded (or not a regular file)
        data = None
    if data is None or len(data) != rec["size"] or sha256_hex(data) != rec["sha256"]:
        raise ChecksumMismatchError(
            f"{where}/{L.INDEX_FILE}: does not match its commit record (damaged); this writer would "
            f"reference its chunks: run dstt verify, and continue on a branch from an intact step")
    entries, _ = parse_index_checked(data, where, rec["sha256"])
    # Keyframe bytes are not kept across writers: the first step delta
    # codes nothing (its chunks are keyframes), dedup still applies.
    with paused_gc():  # (a link per chunk, no cycles: issue 16)
        tails = resolved_tails(entries)
    # (an array all of whose chunks are packed has no zarr.json: a writer
    # packing less, DSTT_PACK_CHUNK_BYTES changed, must write it)
    return tails, {e.array for e in entries if e.packs is None or None in e.packs}
