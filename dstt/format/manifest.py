"""Step documents: build them on write, validate them on read.

A committed step is four files under ``meta/steps/<branch>/<step:020d>/``:
``index.json`` (tensor table and value tree), ``names.json`` (tensor names in
index order), ``stats.npy`` (float64 stats rows in index order) and, written
last and atomically, ``commit.json`` -- the commit marker, holding the
sha256 and size of the other three. Readers trust nothing they read: every
field is type- and bounds-checked and a violation is a CorruptStoreError.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
from typing import Any, cast

import numpy as np

from dstt.errors import CorruptStoreError, FormatVersionError
from dstt.format.entries import MAX_ELEMENTS as MAX_ELEMENTS
from dstt.format.entries import EntryParser, TypeTable, entry_row, is_row
from dstt.format.entries import TensorEntry as TensorEntry
from dstt.format.entries import check_int as _int
from dstt.format.entries import check_str as _str
from dstt.format.entries import need as _need
from dstt.format.entries import parse_entry as parse_entry
from dstt.format.entries import tensor_checksum as tensor_checksum
from dstt.format.layout import (
    LEGACY_STATS_COLUMNS,
    MAX_BRANCHES,
    PRED_FORMAT_VERSION,
    READ_VERSIONS,
    ROWS_FORMAT_VERSION,
    SLOTS_PER_BRANCH,
    STATS_COLUMNS,
)
from dstt.format.pygc import paused_gc
from dstt.format.valuetree import MAX_STATE_DEPTH, MAX_TREE_DEPTH, check_tree_depth  # noqa: F401 - re-exported

# (MAX_ELEMENTS, TensorEntry, parse_entry and tensor_checksum are
# re-exported: they lived here before dstt.format.entries.)


def index_document(version: int, branch: str, step: int, entries: list[TensorEntry], objects: Any) -> bytes:
    """``index.json`` of a step: what :func:`parse_index` reads back. From
    format version 4 (:func:`has_rows` entries), packed one-chunk tensors
    are written as rows (dstt.format.entries)."""
    types = TypeTable()
    if version >= ROWS_FORMAT_VERSION:
        tensors = [entry_row(e, types) if is_row(e) else e.to_json() for e in entries]
    else:
        tensors = [e.to_json() for e in entries]
    doc: dict[str, Any] = {"format_version": version, "branch": branch, "step": step}
    if types.to_json():
        doc["types"] = types.to_json()
    doc["tensors"] = tensors
    doc["objects"] = objects
    return encode_json(doc)


def has_rows(entries: list[TensorEntry]) -> bool:
    """Whether a step of ``entries`` is written with index rows (format version 4)."""
    return any(is_row(e) for e in entries)


def commit_document(*, version: int, branch: str, step: int, seq: int, time: float, world_size: int,
                    n_tensors: int, bytes_total: int, bytes_written: int, bytes_referenced: int,
                    has_pickle: bool, files: dict[str, dict[str, Any]], coding: str | None = None,
                    memory_only: list[tuple[int, int]] | None = None) -> bytes:
    """``commit.json``, the commit marker of a step: what :func:`parse_commit`
    reads back. ``files`` maps index.json, names.json and stats.npy to their
    ``{"sha256", "size"}``; ``coding`` (``"fast"``: a ``compression="auto"``
    step stored without compression because the writer was behind) is
    recorded only when given. ``memory_only`` (issue 14): the steps captured
    into memory only (not persisted) since the branch's previous persisted
    step, as inclusive ``(first, last)`` ranges, ascending; recorded only
    when given and non-empty."""
    ranges = check_memory_only(memory_only, step, f"step {step}") if memory_only else []
    return encode_json({
        "format": "dstt-step", "format_version": version, "branch": branch, "step": step, "seq": seq,
        "time": time, "world_size": world_size, "n_tensors": n_tensors, "bytes_total": bytes_total,
        "bytes_written": bytes_written, "bytes_referenced": bytes_referenced, "has_pickle": has_pickle,
        "stats_columns": list(STATS_COLUMNS), "files": files, **({"coding": coding} if coding else {}),
        **({"memory_only": [list(r) for r in ranges]} if ranges else {}),
    })


#: Memory-only ranges one commit document holds at most.
MAX_MEMORY_ONLY_RANGES = 100_000


def check_memory_only(raw: Any, step: int, where: str) -> list[tuple[int, int]]:
    """Validated ``memory_only`` ranges of a commit of ``step``: a list of
    at most MAX_MEMORY_ONLY_RANGES ``[first, last]`` integer pairs with
    ``first <= last < step``, ascending and disjoint (CorruptStoreError
    otherwise; the writer checks what it records the same way).

    >>> check_memory_only([[1, 3], [5, 5]], 8, "w")
    [(1, 3), (5, 5)]
    """
    _need(isinstance(raw, (list, tuple)) and len(raw) <= MAX_MEMORY_ONLY_RANGES, where,
          f"memory_only must be a list of at most {MAX_MEMORY_ONLY_RANGES} ranges")
    out: list[tuple[int, int]] = []
    prev_last = -1
    for r in raw:
        _need(isinstance(r, (list, tuple)) and len(r) == 2, where, "memory_only ranges must be [first, last] pairs")
        first = _int(r[0], where, "memory_only first step", hi=step - 1)
        last = _int(r[1], where, "memory_only last step", hi=step - 1)
        _need(first <= last, where, f"memory_only range [{first}, {last}] is reversed")
        _need(first > prev_last, where, "memory_only ranges must be ascending and disjoint")
        prev_last = last
        out.append((first, last))
    return out


def stats_columns_of(commit: dict[str, Any]) -> tuple[str, ...]:
    """The stats columns a (parsed) commit's stats.npy holds: its
    ``stats_columns`` when recorded, else the 7 of stores written before it."""
    cols = commit.get("stats_columns")
    return LEGACY_STATS_COLUMNS if cols is None else tuple(cols)


def memory_only_of(commit: dict[str, Any]) -> list[tuple[int, int]]:
    """The memory-only ranges of a (parsed) commit; [] when absent."""
    return [(int(r[0]), int(r[1])) for r in commit.get("memory_only", ())]


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode_json(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def encode_stats(rows: list[list[float]]) -> bytes:
    arr = np.asarray(rows, dtype="<f8").reshape(len(rows), len(STATS_COLUMNS))
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def decode_json(data: bytes, where: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    # ValueError covers UnicodeDecodeError, JSONDecodeError and integers beyond
    # Python's digit limit (sys.get_int_max_str_digits).
    except (ValueError, RecursionError) as e:
        raise CorruptStoreError(f"{where}: not valid JSON ({e.__class__.__name__}: {e})") from None


@functools.lru_cache(maxsize=64)
def _stats_header(n: int, ncols: int = len(STATS_COLUMNS)) -> bytes:
    """The .npy header np.save writes for an (n, ncols) float64 table."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": "<f8", "fortran_order": False, "shape": (n, ncols)})
    return buf.getvalue()


def _stored_stats(data: bytes, n: int, ncols: int, where: str) -> np.ndarray:
    # Fast path (history reads thousands of these): exactly the header dstt
    # writes, then the raw table -- no parsing of the header dict needed.
    header = _stats_header(n, ncols)
    if bytes(data[: len(header)]) == header and len(data) == len(header) + n * ncols * 8:
        return np.frombuffer(data, dtype="<f8", offset=len(header)).reshape(n, ncols)
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as e:  # numpy raises ValueError/OSError/EOFError variants
        raise CorruptStoreError(f"{where}: unreadable stats ({e})") from None
    if arr.dtype != np.dtype("<f8") or arr.shape != (n, ncols):
        raise CorruptStoreError(f"{where}: stats have shape {arr.shape} {arr.dtype}, expected ({n}, {ncols}) float64")
    return cast('np.ndarray', arr)  # validated above


def decode_stats(data: bytes, n: int, where: str, columns: tuple[str, ...] | None = None) -> np.ndarray:
    """A step's stats table as an ``(n, len(STATS_COLUMNS))`` float64 array
    in STATS_COLUMNS order, whatever columns it was written with:
    ``columns`` are the stored ones (the commit's ``stats_columns``, see
    :func:`stats_columns_of`); a column this dstt knows that the step lacks
    reads as NaN, a stored column it does not know is ignored. Without
    ``columns``, a table of STATS_COLUMNS or of the 7 legacy columns is taken
    for what it is."""
    if columns is None:
        legacy = len(STATS_COLUMNS) != len(LEGACY_STATS_COLUMNS) and (
            bytes(data[:len(_stats_header(n, len(LEGACY_STATS_COLUMNS)))]) ==
            _stats_header(n, len(LEGACY_STATS_COLUMNS)))
        columns = LEGACY_STATS_COLUMNS if legacy else STATS_COLUMNS
    arr = _stored_stats(data, n, len(columns), where)
    if columns == STATS_COLUMNS:
        return arr
    out = np.full((n, len(STATS_COLUMNS)), np.nan)
    for j, c in enumerate(columns):
        if c in _STATS_POS:
            out[:, _STATS_POS[c]] = arr[:, j]
    return out


_STATS_POS = {c: i for i, c in enumerate(STATS_COLUMNS)}
#: Stats columns one step records at most (names of at most 64 characters).
MAX_STATS_COLUMNS = 64


def parse_commit(data: bytes, where: str) -> dict[str, Any]:
    doc = decode_json(data, where)
    _need(isinstance(doc, dict), where, "commit must be a JSON object")
    version = doc.get("format_version")
    if version not in READ_VERSIONS:
        raise FormatVersionError(
            f"{where}: step written with format version {version!r}, this dstt reads "
            + " and ".join(map(str, READ_VERSIONS)))
    _int(doc.get("step"), where, "step")
    _int(doc.get("seq"), where, "seq", hi=SLOTS_PER_BRANCH - 1)  # a slot of its branch
    files = doc.get("files")
    _need(isinstance(files, dict), where, "files must be an object")
    for fname in ("index.json", "names.json", "stats.npy"):
        f = files.get(fname)
        _need(isinstance(f, dict), where, f"missing file record {fname}")
        _str(f.get("sha256"), where, f"{fname} sha256")
        _int(f.get("size"), where, f"{fname} size")
    for k in ("bytes_written", "bytes_referenced", "n_tensors"):
        _int(doc.get(k), where, k)
    _need(isinstance(doc.get("time"), (int, float)), where, "time must be a number")
    cols = doc.get("stats_columns")
    if cols is not None:
        _need(isinstance(cols, list) and 0 < len(cols) <= MAX_STATS_COLUMNS
              and all(isinstance(c, str) and 0 < len(c) <= 64 for c in cols) and len(set(cols)) == len(cols),
              where, f"stats_columns must list at most {MAX_STATS_COLUMNS} distinct column names")
    if "memory_only" in doc:
        check_memory_only(doc["memory_only"], doc["step"], where)
    return cast('dict[str, Any]', doc)  # validated above


def parse_index(data: bytes, where: str) -> tuple[list[TensorEntry], Any]:
    """The entries and value tree of an ``index.json``, validated."""
    with paused_gc():  # (millions of containers, no cycles)
        doc = decode_json(data, where)
        _need(isinstance(doc, dict), where, "index must be a JSON object")
        raw = doc.get("tensors")
        _need(isinstance(raw, list), where, "tensors must be a list")
        version = doc.get("format_version")
        parser = EntryParser(doc.get("types"), where,
                             rows=version in READ_VERSIONS and version >= ROWS_FORMAT_VERSION)
        entries = [parser.entry(r) for r in raw]
    step = doc.get("step")
    for e in entries:
        if e.pred is not None:
            _need(isinstance(version, int) and version >= PRED_FORMAT_VERSION, where,
                  f"tensor {e.name!r}: a pred record in an index of format version {version!r}")
            _need(all(c is None or c.cur <= step for c in e.pred.chunks) if type(step) is int else False, where,
                  f"tensor {e.name!r}: a pred chunk coded after this step")
    names = {e.name for e in entries}
    _need(len(names) == len(entries), where, "duplicate tensor names")
    objects = doc.get("objects")
    check_tree_depth(objects, where)
    return entries, objects


def parse_objects(data: bytes, where: str) -> Any:
    """The value tree of an ``index.json`` alone (what reads of values
    need), validated as :func:`parse_index` validates it; no tensor entry
    is built (300 of them cost ~10 ms a step).

    >>> parse_objects(b'{"format_version": 1, "tensors": [], "objects": {"lr": 0.1}}', "index.json")
    {'lr': 0.1}
    """
    with paused_gc():
        doc = decode_json(data, where)
    _need(isinstance(doc, dict), where, "index must be a JSON object")
    _need(isinstance(doc.get("tensors"), list), where, "tensors must be a list")
    objects = doc.get("objects")
    check_tree_depth(objects, where)
    return objects


#: The last index this process parsed or wrote: (sha256 of its bytes,
#: entries, value tree). A writer's next step (dstt.save opens a new writer
#: per call) and a reader right after it read back the index just written:
#: 100,000 entries took ~4 s to decode and validate (issue 16).
_LAST_INDEX: tuple[str, list[TensorEntry], Any] | None = None


def remember_index(sha256: str, entries: list[TensorEntry], objects: Any) -> None:
    """Record the index whose bytes have ``sha256`` as parsed (the writer
    calls this with what it just wrote; ``objects`` as JSON would give it).
    Callers treat entries and tree as read-only."""
    global _LAST_INDEX
    _LAST_INDEX = (sha256, entries, objects)


def parse_index_checked(data: bytes, where: str, sha256: str) -> tuple[list[TensorEntry], Any]:
    """:func:`parse_index` of bytes the caller has checked against the
    ``sha256`` their commit records: the last index parsed or written in
    this process with that digest is reused (content-addressed, so never
    another document's entries)."""
    last = _LAST_INDEX
    if last is not None and last[0] == sha256:
        return last[1], last[2]
    entries, objects = parse_index(data, where)
    remember_index(sha256, entries, objects)
    return entries, objects


def parse_names(data: bytes, where: str) -> list[str]:
    doc = decode_json(data, where)
    _need(isinstance(doc, list) and all(isinstance(x, str) for x in doc), where, "names must be a list of strings")
    return cast('list[str]', doc)  # validated above


SKIP_FORMAT = "dstt-skip"


def skip_document(branch: str, step: int, reason: str, time: float) -> bytes:
    """A skip record (docs/format.md "Skip records")."""
    return encode_json({"format": SKIP_FORMAT, "branch": branch, "step": step, "reason": reason, "time": time})


def parse_skip(data: bytes, where: str, branch: str | None = None) -> dict[str, Any]:
    """A skip record, validated like every other document (a store may be
    someone else's): format, branch (``branch`` when given), non-negative
    integer step, text reason, numeric time. Records written before the
    format tag was checked carry it too."""
    doc = decode_json(data, where)
    _need(isinstance(doc, dict), where, "not a skip record (not a JSON object)")
    _need(doc.get("format") == SKIP_FORMAT, where, f"not a skip record (format {doc.get('format')!r})")
    b = _str(doc.get("branch"), where, "branch")
    _need(branch is None or b == branch, where, f"skip record of branch {b!r} under branch {branch!r}")
    _int(doc.get("step"), where, "step")
    _str(doc.get("reason"), where, "reason")
    _need(isinstance(doc.get("time"), (int, float)) and not isinstance(doc.get("time"), bool), where,
          "time must be a number")
    return cast('dict[str, Any]', doc)  # validated above


def parse_branch(data: bytes, where: str) -> dict[str, Any]:
    doc = decode_json(data, where)
    _need(isinstance(doc, dict), where, "branch document must be an object")
    _str(doc.get("name"), where, "name")
    _int(doc.get("id"), where, "id", hi=MAX_BRANCHES - 1)  # slots of this id must fit the slot axis
    parent = doc.get("parent")
    if parent is not None:
        _need(isinstance(parent, dict), where, "parent must be an object or null")
        _str(parent.get("branch"), where, "parent branch")
        _int(parent.get("step"), where, "parent step")
    return cast('dict[str, Any]', doc)  # validated above
