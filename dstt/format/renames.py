"""Rename journal records (``meta/renames/<name>.json``, docs/format.md):
a rename under way (:mod:`dstt.format.branchrename`) keeps writers and
branch creation off both names until it is finished. Torch-free, and
imports nothing that takes locks (``lock.acquire`` reads these)."""

from __future__ import annotations

from dstt.errors import ConfigError, CorruptStoreError
from dstt.format import layout as L
from dstt.format.backends import Backend
from dstt.format.manifest import decode_json

#: Journal records of renames under way (one per name involved).
RENAMES = f"{L.META}/renames"
RENAME_FORMAT = "dstt-rename"


def rename_key(name: str) -> str:
    """``meta/renames/<name>.json``."""
    return f"{RENAMES}/{L.validate_branch(name)}.json"


def pending_rename(backend: Backend, name: str) -> tuple[str, str] | None:
    """(old, new) of an interrupted rename involving branch ``name``, or None.
    A damaged record is CorruptStoreError (never taken for "no rename")."""
    key = rename_key(name)
    raw = backend.get(key, max_bytes=L.MAX_DOC_BYTES)
    if raw is None:
        return None
    doc = decode_json(raw, key)
    if (not isinstance(doc, dict) or doc.get("format") != RENAME_FORMAT
            or not isinstance(doc.get("from"), str) or not isinstance(doc.get("to"), str)
            or name not in (doc["from"], doc["to"])):
        raise CorruptStoreError(f"{key}: not a rename record of branch {name!r}")
    return L.validate_branch(doc["from"]), L.validate_branch(doc["to"])


def refuse_if_renaming(backend: Backend, name: str) -> None:
    """ConfigError when an interrupted rename involves ``name`` (writers and
    branch creation call this: the rename must be finished first)."""
    pending = pending_rename(backend, name)
    if pending is not None:
        old, new = pending
        raise ConfigError(f"branch {name!r} of {backend.url} is being renamed ({old!r} -> {new!r}), or a rename "
                          f"was interrupted: run 'dstt branch -m {backend.url} {old} {new}' to finish it")


