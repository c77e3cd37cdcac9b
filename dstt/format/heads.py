"""Branch heads: the latest committed step of a branch without listing every
step (issue 11 item 5).

``meta/heads/<branch>.json`` is written by the branch's writer with every
step, *before* the step's commit marker and in the same durability batch
(it is put, then the store is synced, then the marker is renamed into
place)::

    {"format": "dstt-head", "format_version": 1, "branch": "main",
     "step": 12, "seq": 12, "prev": {"step": 11, "seq": 11},
     "steps_dir": [1763700000123456789, 14], "sha256": "<of the rest>"}

It names the step being committed (``step``/``seq``) and the latest step
committed before it (``prev``, null for none). So the latest committed step
is ``step`` if its commit marker exists with that ``seq``, else ``prev``
(the writer died or failed between the two), again only if ``prev``'s
marker exists with its ``seq``. ``steps_dir`` is the (mtime in ns, link
count) of ``meta/steps/<branch>/`` right after the step's directory was
made, where the backend has directories: any step directory made or removed
since (a writer that does not write heads, a prune, a gc, a hand edit)
changes it.

``sha256`` is the sha256 of the document without it (compact JSON), so a
damaged head is not mistaken for a valid one.

The commit markers win: a head that is missing, unreadable, fails its
sha256, names a marker that has another ``seq`` (or is absent while the
step's index.json is absent too), or whose ``steps_dir`` differs, is
ignored and the branch's steps are listed instead (what stores written
before heads existed always get). A stale or damaged head can therefore
never make a writer reuse a slot or skip a committed step. Readers never
write a head; the next commit rewrites it.

>>> import tempfile, torch, dstt
>>> from dstt.format.backends import open_backend
>>> path = tempfile.mkdtemp() + "/run"
>>> for s in (3, 7):
...     _ = dstt.save(path, s, {"w": torch.ones(1)})
>>> latest_committed(open_backend(path), "main").step
7
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dstt.errors import DsttError, StepNotFoundError
from dstt.format import layout as L
from dstt.format.backends import Backend
from dstt.format.manifest import decode_json, encode_json, parse_commit, sha256_hex

HEADS = f"{L.META}/heads"


def head_key(branch: str) -> str:
    return f"{HEADS}/{branch}.json"


@dataclass(frozen=True)
class Head:
    """The latest committed step of a branch: its number, slot sequence and
    commit document (None for a branch without committed steps)."""

    step: int | None
    seq: int | None
    commit: dict[str, Any] | None


EMPTY = Head(None, None, None)


def steps_dir_stamp(backend: Backend, branch: str) -> list[int] | None:
    """(mtime ns, link count) of the branch's steps directory, where the
    backend has directories (None elsewhere, or when it does not exist)."""
    stat_dir = getattr(backend, "stat_dir", None)
    if stat_dir is None:
        return None
    st = stat_dir(L.steps_prefix(branch).rstrip("/"))
    return None if st is None else [int(st.st_mtime_ns), int(st.st_nlink)]


def write_head(backend: Backend, branch: str, step: int, seq: int, prev: tuple[int, int] | None) -> None:
    """Record that ``step`` (slot sequence ``seq``) is being committed after
    ``prev`` (step, seq). Call after the step's files are put (its
    directory exists) and before the sync that precedes the commit marker."""
    doc: dict[str, Any] = {"format": "dstt-head", "format_version": 1, "branch": branch, "step": step,
                           "seq": seq, "prev": None if prev is None else {"step": prev[0], "seq": prev[1]},
                           "steps_dir": steps_dir_stamp(backend, branch)}
    doc["sha256"] = sha256_hex(encode_json(doc))
    backend.put(head_key(branch), encode_json(doc))


def _point(v: Any) -> tuple[int, int] | None:
    if not isinstance(v, dict):
        return None
    step, seq = v.get("step"), v.get("seq")
    if not isinstance(step, int) or isinstance(step, bool) or not isinstance(seq, int) or isinstance(seq, bool):
        return None
    if not 0 <= step <= L.MAX_STEP or not 0 <= seq < L.SLOTS_PER_BRANCH:
        return None
    return step, seq


def _committed(backend: Backend, branch: str, point: tuple[int, int]) -> dict[str, Any] | None:
    """The commit document of ``point`` if its marker exists and records that
    step and seq; None otherwise."""
    where = L.step_dir(branch, point[0])
    try:
        raw = backend.get(f"{where}/{L.COMMIT_FILE}", max_bytes=L.MAX_DOC_BYTES)
        if raw is None:
            return None
        commit = parse_commit(raw, where)
    except (DsttError, OSError):
        return None
    if commit.get("step") != point[0] or commit.get("seq") != point[1]:
        return None
    return commit


def head_record(backend: Backend, branch: str) -> Head | None:
    """The latest committed step according to the head record, or None when
    the record cannot be trusted (see the module docstring)."""
    try:
        raw = backend.get(head_key(branch), max_bytes=L.MAX_DOC_BYTES)
        doc = None if raw is None else decode_json(raw, head_key(branch))
    except (DsttError, OSError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != "dstt-head" or doc.get("branch") != branch:
        return None
    signed = {k: v for k, v in doc.items() if k != "sha256"}
    if doc.get("sha256") != sha256_hex(encode_json(signed)):
        return None  # damaged (or written by hand)
    cur = _point(doc)
    prev = doc.get("prev")
    prev_point = _point(prev)
    if cur is None or (prev is not None and prev_point is None):
        return None
    if prev_point is not None and not (prev_point[0] < cur[0] and prev_point[1] < cur[1]):
        return None
    if doc.get("steps_dir") != steps_dir_stamp(backend, branch):
        return None  # steps were added or removed by something else since
    commit = _committed(backend, branch, cur)
    if commit is not None:
        return Head(cur[0], cur[1], commit)
    # No marker with that seq for the step the head names. Only a writer that
    # stopped between the head and the marker leaves that, and it leaves the
    # step's other files: anything else is not trusted.
    where = L.step_dir(branch, cur[0])
    if backend.exists(f"{where}/{L.COMMIT_FILE}") or not backend.exists(f"{where}/{L.INDEX_FILE}"):
        return None
    if prev_point is None:
        return EMPTY
    commit = _committed(backend, branch, prev_point)
    return None if commit is None else Head(prev_point[0], prev_point[1], commit)


def latest_committed(backend: Backend, branch: str) -> Head:
    """The latest committed step of ``branch``: from its head record when
    that agrees with the commit markers, else by listing the branch's steps."""
    head = head_record(backend, branch)
    if head is not None:
        return head
    from dstt.format.root import committed_steps

    for _ in range(3):
        steps = committed_steps(backend, branch)
        if not steps:
            return EMPTY
        where = L.step_dir(branch, steps[-1])
        raw = backend.get(f"{where}/{L.COMMIT_FILE}", max_bytes=L.MAX_DOC_BYTES)
        if raw is not None:
            commit = parse_commit(raw, where)
            return Head(steps[-1], commit["seq"], commit)
        # removed between the listing and now (a prune beside us): list again
    raise StepNotFoundError(f"the latest step of branch {branch!r} keeps disappearing while it is read")


__all__ = ["Head", "head_key", "head_record", "latest_committed", "write_head", "HEADS"]
