"""Deleting a branch (``dstt branch -d``), torch-free.

A branch is its document (``meta/branches/<name>.json``), its committed
steps, skip and incident records and head record; its chunks are shared
with nothing but steps that reference them, so once the steps are gone
``dstt gc`` frees them. The branch's id claim (``meta/branch_ids/<id>``) is
kept: the id names the chunk slots its data was written to, and is never
handed to a new branch (a new one could otherwise meet chunks gc has not
collected yet). The id is marked retired (``meta/retired_ids/<id>``), which
tells gc that no writer can be adding chunks in its slots: gc otherwise
leaves alone the slots of ids it holds no branch lock for (a branch being
created).

Order (a crash part way leaves a branch with fewer steps, never steps
without a branch; deleting again finishes): every branch's lock and the
branch-set lock are held (no writer on it, none forking from it); the steps
go newest first (commit marker first, as prune does), then the records,
then the branch document.

>>> import tempfile, torch, dstt
>>> from dstt.format.backends import open_backend
>>> path = tempfile.mkdtemp() + "/run"
>>> for s in range(3):
...     _ = dstt.save(path, s, {"w": torch.full((4,), float(s))})
>>> _ = dstt.save(path, 2, {"w": torch.zeros(4)}, branch="try", parent=("main", 1))
>>> delete_branch(open_backend(path), "try")
['try']
>>> dstt.open(path).branches()
['main']
"""

from __future__ import annotations

from dstt.errors import BranchNotFoundError, ConfigError
from dstt.format import layout as L
from dstt.format.backends import Backend
from dstt.format.heads import head_key
from dstt.format.root import committed_steps, list_branches, load_branch


def children(backend: Backend) -> dict[str, list[str]]:
    """Branches forked from each branch: ``{parent: [child, ...]}``."""
    out: dict[str, list[str]] = {}
    for name in list_branches(backend):
        parent = load_branch(backend, name).parent
        if parent is not None:
            out.setdefault(parent[0], []).append(name)
    return out


def descendants(backend: Backend, name: str) -> list[str]:
    """Every branch forked from ``name``, directly or not (children before
    their own children)."""
    kids = children(backend)
    out: list[str] = []
    todo = list(kids.get(name, []))
    while todo:
        b = todo.pop(0)
        if b not in out and b != name:
            out.append(b)
            todo.extend(kids.get(b, []))
    return out


def delete_branch(backend: Backend, name: str, *, force: bool = False, dry_run: bool = False) -> list[str]:
    """Delete branch ``name``; the names deleted (``name`` last). A branch
    other branches fork from is refused (ConfigError naming them) unless
    ``force``, which deletes them too. Refuses while a writer holds any
    branch (StoreLockedError). ``dry_run``: only say what would go."""
    from dstt.format.lock import acquire_all
    from dstt.format.renames import refuse_if_renaming

    load_branch(backend, name)  # BranchNotFoundError with the known names
    refuse_if_renaming(backend, name)  # (the id is shared with the other name until it finishes)
    doomed = descendants(backend, name)
    if doomed and not force:
        shown = ", ".join(repr(b) for b in doomed[:8]) + (" ..." if len(doomed) > 8 else "")
        raise ConfigError(f"branch {name!r} has branches forked from it ({shown}): deleting it would take their "
                          f"history; --force deletes them too")
    order = [*reversed(doomed), name]  # children first: a crash leaves no child without its parent
    if dry_run:
        return order
    with acquire_all(backend):
        for b in order:
            _delete_locked(backend, b)
    return order


def remove_steps(backend: Backend, name: str) -> None:
    """Branch ``name``'s steps (newest first, each commit marker first, as
    gc.remove_step: a crash leaves a prefix of committed steps), its skip
    and incident records and its head; its document stays (the caller's)."""
    for step in reversed(committed_steps(backend, name)):
        where = L.step_dir(name, step)
        backend.delete(f"{where}/{L.COMMIT_FILE}")
        backend.sync()
        backend.delete_prefix(where)
    for prefix in (L.steps_prefix(name), L.skips_prefix(name), L.incidents_prefix(name)):
        backend.delete_prefix(prefix.rstrip("/"))
    backend.delete(head_key(name))


def _delete_locked(backend: Backend, name: str) -> None:
    if not backend.exists(L.branch_key(name)):
        raise BranchNotFoundError(f"no branch {name!r} in {backend.url} (deleted meanwhile)")
    remove_steps(backend, name)
    backend.put(retired_key(load_branch(backend, name).id), name.encode())
    backend.sync()
    backend.delete(L.branch_key(name))
    backend.sync()


#: Ids of deleted branches (their chunk slots hold nothing a writer adds).
RETIRED_IDS = f"{L.META}/retired_ids"


def retired_key(branch_id: int) -> str:
    return f"{RETIRED_IDS}/{branch_id}"


def retired_ids(backend: Backend) -> set[int]:
    """Ids of deleted branches."""
    return {int(n) for n in backend.list_dir(RETIRED_IDS) if n.isdigit()}
