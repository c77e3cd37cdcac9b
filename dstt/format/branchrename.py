"""Renaming a branch (``dstt branch -m STORE OLD NEW``), torch-free.

A branch's name appears in: its document (``meta/branches/<name>.json``),
its step directories (``meta/steps/<name>/...``, whose ``index.json`` and
``commit.json`` record the name), its skip and incident records, its head
record, and the documents of the branches forked from it (``parent``).
Chunks are named by the branch *id* (slots), which a rename keeps: no
tensor data moves.

The rename copies, then removes, so a crash at any moment leaves a store
that opens and verifies, and running the same rename again finishes it:

1. Every branch's lock and the branch-set lock are taken (a live capture
   on any branch refuses the rename: StoreLockedError).
2. A journal record ``meta/renames/<name>.json`` is written under both
   names. While it exists no writer opens either branch
   (:func:`dstt.format.lock.acquire` refuses, naming the command that
   finishes the rename) and no branch of either name is created.
3. Each committed step is copied to the new name (its files first, its
   commit marker last, with the name rewritten and ``index.json``'s
   checksum recorded anew), then skip and incident records.
4. The new branch document is created with the old one's id and parent:
   from here the new name answers with every step.
5. Children's documents are re-pointed at the new name (each an atomic
   replace).
6. The old name's steps go newest first (commit marker first), then its
   records, head and document (what ``branch -d`` does, without retiring
   the id, which the new name keeps).
7. The journal records are removed.

Between 4 and 6 both names exist with the same id and the same steps: reads
of either are correct, and the journal keeps writers off both, so no two
writers can ever share the id's chunk slots.

>>> import tempfile, torch, dstt
>>> from dstt.format.backends import open_backend
>>> path = tempfile.mkdtemp() + "/run"
>>> for s in range(3):
...     _ = dstt.save(path, s, {"w": torch.full((4,), float(s))})
>>> rename_branch(open_backend(path), "main", "trunk")["steps"]
3
>>> dstt.open(path).branches(), float(dstt.open(path + "@trunk:2").state_dict()["w"][0])
(['trunk'], 2.0)
"""

from __future__ import annotations

from typing import Any

from dstt.errors import BranchExistsError, BranchNotFoundError, ConfigError, CorruptStoreError
from dstt.format import layout as L
from dstt.format.backends import Backend
from dstt.format.branchops import remove_steps
from dstt.format.manifest import decode_json, encode_json, parse_commit, sha256_hex
from dstt.format.renames import RENAME_FORMAT, pending_rename, refuse_if_renaming, rename_key  # noqa: F401 - re-exported
from dstt.format.root import committed_steps, list_branches, load_branch


def _check(backend: Backend, old: str, new: str) -> bool:
    """Validate the request; True when it resumes an interrupted rename."""
    L.validate_branch(old)
    L.validate_branch(new)
    if old == new:
        raise ConfigError(f"branch {old!r} already has that name")
    mine = (old, new)
    for name in mine:
        other = pending_rename(backend, name)
        if other is not None and other != mine:
            raise ConfigError(f"an interrupted rename {other[0]!r} -> {other[1]!r} involves {name!r}: "
                              f"finish it first (dstt branch -m {backend.url} {other[0]} {other[1]})")
    resuming = pending_rename(backend, old) == mine or pending_rename(backend, new) == mine
    if not resuming:
        load_branch(backend, old)  # BranchNotFoundError with the known names
        if backend.exists(L.branch_key(new)):
            raise BranchExistsError(f"branch {new!r} already exists in {backend.url}")
    elif not backend.exists(L.branch_key(old)) and not backend.exists(L.branch_key(new)):
        raise BranchNotFoundError(f"neither {old!r} nor {new!r} is a branch of {backend.url}")
    return resuming


def _children(backend: Backend, name: str) -> list[str]:
    return [b for b in list_branches(backend) if (load_branch(backend, b).parent or ("",))[0] == name]


def rename_branch(backend: Backend, old: str, new: str, *, dry_run: bool = False) -> dict[str, Any]:
    """Rename branch ``old`` to ``new`` (module docstring); what was (or, with
    ``dry_run``, would be) done: ``{"from", "to", "steps", "children",
    "resumed"}``. Refuses an existing ``new`` (BranchExistsError), an unknown
    ``old`` (BranchNotFoundError) and a live writer on any branch
    (StoreLockedError). Running it again after a crash finishes it."""
    from dstt.format.lock import acquire_all, lock_holder

    resuming = _check(backend, old, new)
    src = old if backend.exists(L.branch_key(old)) else new
    plan = {"from": old, "to": new, "steps": len(committed_steps(backend, src)),
            "children": _children(backend, src), "resumed": resuming}
    if dry_run:
        for b in list_branches(backend):
            held = lock_holder(backend, b)
            if held is not None:
                from dstt.errors import StoreLockedError

                raise StoreLockedError(f"branch {b!r} of {backend.url} is locked by a live writer "
                                       f"({held.describe()}): a rename would be refused")
        return plan
    with acquire_all(backend):
        resuming = _check(backend, old, new)  # (again, under the locks)
        journal = encode_json({"format": RENAME_FORMAT, "from": old, "to": new})
        for name in (new, old):  # the new name's first (and removed last): never a window where it is free
            backend.put_atomic(rename_key(name), journal)
        backend.sync()
        if backend.exists(L.branch_key(old)):
            info = load_branch(backend, old)
            for step in committed_steps(backend, old):
                _copy_step(backend, old, new, step)
            _copy_records(backend, old, new)
            doc = encode_json({**info.to_dict(), "name": new})
            if not backend.put_if_absent(L.branch_key(new), doc):
                if load_branch(backend, new).id != info.id:
                    raise BranchExistsError(f"branch {new!r} was created meanwhile in {backend.url}")
            backend.sync()
        for child in _children(backend, old):
            _repoint(backend, child, new)
        _remove_old(backend, old)
        backend.delete(rename_key(old))
        backend.sync()
        backend.delete(rename_key(new))
        backend.sync()
    return plan


def _copy_step(backend: Backend, old: str, new: str, step: int) -> None:
    """Copy one committed step to the new name: its files, then its commit
    marker (name rewritten, index checksum recorded anew). A step already
    committed under the new name (a resumed rename) is left as it is."""
    src, dst = L.step_dir(old, step), L.step_dir(new, step)
    if backend.exists(f"{dst}/{L.COMMIT_FILE}"):
        return
    raw = backend.get(f"{src}/{L.COMMIT_FILE}", max_bytes=L.MAX_DOC_BYTES)
    if raw is None:
        raise CorruptStoreError(f"{src}: commit marker vanished during the rename")
    commit = parse_commit(raw, src)
    for fname in sorted(backend.list_dir(src)):
        if fname == L.COMMIT_FILE or fname.startswith(L.COMMIT_FILE):
            continue
        size = commit["files"].get(fname, {}).get("size")
        data = backend.get(f"{src}/{fname}", max_bytes=size if isinstance(size, int) else L.MAX_DOC_BYTES)
        if data is None:
            continue
        if fname == L.INDEX_FILE:
            if sha256_hex(data) != commit["files"][fname]["sha256"]:
                raise CorruptStoreError(f"{src}/{fname}: checksum does not match the commit record")
            index = decode_json(data, f"{src}/{fname}")
            index["branch"] = new
            data = encode_json(index)
            commit["files"][fname] = {"sha256": sha256_hex(data), "size": len(data)}
        backend.put(f"{dst}/{fname}", data)
    commit["branch"] = new
    backend.sync()
    backend.put_atomic(f"{dst}/{L.COMMIT_FILE}", encode_json(commit))


def _copy_records(backend: Backend, old: str, new: str) -> None:
    """Skip and incident records, the name inside rewritten."""
    for prefix in (L.skips_prefix(old), L.incidents_prefix(old)):
        for key in backend.list_prefix(prefix.rstrip("/")):
            data = backend.get(key, max_bytes=L.MAX_DOC_BYTES)
            if data is None:
                continue
            doc = decode_json(data, key)
            if isinstance(doc, dict) and doc.get("branch") == old:
                doc["branch"] = new
            backend.put(prefix.replace(f"/{old}/", f"/{new}/", 1) + key[len(prefix):], encode_json(doc))
    backend.sync()


def _repoint(backend: Backend, child: str, new: str) -> None:
    info = load_branch(backend, child)
    assert info.parent is not None
    doc = info.to_dict()
    doc["parent"]["branch"] = new
    backend.put_atomic(L.branch_key(child), encode_json(doc))


def _remove_old(backend: Backend, old: str) -> None:
    """The old name's steps (newest first, commit marker first), records,
    head and document; its id stays with the new name."""
    remove_steps(backend, old)
    backend.sync()
    backend.delete(L.branch_key(old))
    backend.sync()
