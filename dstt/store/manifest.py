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
import math
import re
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from dstt.errors import CorruptStoreError, FormatVersionError
from dstt.store.chunks import ChunkGrid
from dstt.store.codec import CodecSpec
from dstt.store.delta import DELTA_ITEMSIZES
from dstt.store.dtypes import DtypeInfo, info_for_name
from dstt.store.layout import (
    DELTA_SUFFIX,
    LEGACY_STATS_COLUMNS,
    MAX_ARRAY_PATH,
    MAX_BRANCHES,
    MAX_SLOTS,
    READ_VERSIONS,
    SLOTS_PER_BRANCH,
    STATS_COLUMNS,
    TENSORS,
)
from dstt.store.packs import PackRange
from dstt.store.valuetree import MAX_STATE_DEPTH, MAX_TREE_DEPTH, check_tree_depth  # noqa: F401 - re-exported

#: What array paths written by dstt look like (layout.escape_component's
#: alphabet plus '@' and '/'); anything else in an index is hostile.
_ARRAY_PATH_RE = re.compile(r"^[A-Za-z0-9._%@/-]{1," + str(MAX_ARRAY_PATH) + r"}$")

#: Upper bound on any stored tensor (elements); hostile shapes fail early.
MAX_ELEMENTS = 1 << 48

@dataclass
class TensorEntry:
    """One logical tensor of a committed step, as recorded in index.json."""

    name: str
    kind: str
    dtype: DtypeInfo
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    codec: CodecSpec
    array: str
    #: Per chunk (C order over the chunk grid): the slot holding it, the
    #: CRC-32C of its raw bytes (before compression), and its sha256 where the
    #: writer computed one (only to confirm dedup; None otherwise). Equal CRCs
    #: alone never prove equal bytes.
    slots: list[int]
    crcs: list[int]
    sha256: list[str | None]
    #: sha256 of the chunk CRCs (4-byte little endian, chunk order).
    checksum: str
    written: int
    stats: dict[str, float] = field(default_factory=dict)
    #: Delta coding (format version 2; docs/format.md "Delta chunks"): per
    #: chunk, None where the chunk at ``slots[i]`` of ``array`` is stored
    #: whole (a keyframe), else the slot of the keyframe in ``array`` that the
    #: chunk at ``slots[i]`` of ``delta_array`` is the difference to. Both
    #: None for tensors that are not delta coded.
    keyframes: list[int | None] | None = None
    delta_array: str | None = None
    #: Packs (format version 3; docs/format.md "Packs"): per chunk, None
    #: where the chunk is a chunk file of ``array``, else the range of the
    #: pack (written for the step at ``slots[i]``) that holds it. None when
    #: no chunk of the tensor is packed.
    packs: list[PackRange | None] | None = None

    def keyframe(self, index: int) -> int | None:
        """The keyframe slot chunk ``index`` is coded against, None if stored whole."""
        return None if self.keyframes is None else self.keyframes[index]

    def pack(self, index: int) -> PackRange | None:
        """Where packed chunk ``index`` lives, None if it is a chunk file."""
        return None if self.packs is None else self.packs[index]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def chunk_grid(self) -> ChunkGrid:
        # Cached by hand (functools.cached_property locks on first use, per
        # instance): asked several times per chunk read; shape and
        # chunk_shape are never changed once an entry is built.
        grid = self.__dict__.get("_chunk_grid")
        if grid is None:
            grid = self.__dict__["_chunk_grid"] = ChunkGrid(self.shape, self.chunk_shape)
        return cast(ChunkGrid, grid)

    @property
    def grid(self) -> tuple[int, ...]:
        return self.chunk_grid.grid

    @property
    def nchunks(self) -> int:
        return self.chunk_grid.nchunks

    def coords(self, index: int) -> tuple[int, ...]:
        return self.chunk_grid.coords(index)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "dtype": self.dtype.logical,
            "shape": list(self.shape),
            "chunk_shape": list(self.chunk_shape),
            "codec": _codecs_json(self.codec, self.dtype.itemsize),
            "array": self.array,
            "slots": self.slots,
            "crcs": self.crcs,
            "sha256": self.sha256,
            "checksum": self.checksum,
            "written": self.written,
            **({} if self.keyframes is None else
               {"delta": {"array": self.delta_array, "keyframes": self.keyframes}}),
            **({} if self.packs is None else {"pack": [None if p is None else list(p) for p in self.packs]}),
        }


@functools.lru_cache(maxsize=256)
def _codecs_json(codec: CodecSpec, itemsize: int) -> list[dict[str, Any]]:
    """codec.codecs_json, built once per (codec, itemsize): tens of thousands
    of entries per index share a few (issue 16). Read only: encoded at once."""
    return codec.codecs_json(itemsize)


def index_document(version: int, branch: str, step: int, entries: list[TensorEntry], objects: Any) -> bytes:
    """``index.json`` of a step: what :func:`parse_index` reads back."""
    return encode_json({"format_version": version, "branch": branch, "step": step,
                        "tensors": [e.to_json() for e in entries], "objects": objects})


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


def tensor_checksum(crcs: list[int]) -> str:
    """A tensor's checksum: sha256 of its chunk CRC-32Cs (uint32 LE, chunk order)."""
    return hashlib.sha256(b"".join(c.to_bytes(4, "little") for c in crcs)).hexdigest()


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


# ----------------------------------------------------------------------------- validation helpers


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise CorruptStoreError(f"{where}: {what}")


def _int(v: Any, where: str, what: str, lo: int = 0, hi: int | None = None) -> int:
    if type(v) is int and v >= lo and (hi is None or v <= hi):
        return v  # the common case, no message built (a bool is not of type int)
    _need(isinstance(v, int) and not isinstance(v, bool), where, f"{what} must be an integer, got {type(v).__name__}")
    _need(v >= lo and (hi is None or v <= hi), where, f"{what} {v} out of range")
    return cast('int', v)  # validated above


def _str(v: Any, where: str, what: str) -> str:
    if type(v) is str:
        return v
    _need(isinstance(v, str), where, f"{what} must be a string, got {type(v).__name__}")
    return cast('str', v)  # validated above


def _shape(v: Any, where: str, what: str, positive: bool = False) -> tuple[int, ...]:
    if not (isinstance(v, list) and len(v) <= 32):
        _need(False, where, f"{what} must be a list of at most 32 sizes")
    out = tuple(_int(x, where, what, lo=1 if positive else 0, hi=MAX_ELEMENTS) for x in v)
    return out


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


def parse_entry(raw: Any, where: str, codecs: list[tuple[Any, CodecSpec]] | None = None) -> TensorEntry:
    """One tensor entry of an index, validated. ``codecs``: (codec JSON,
    CodecSpec) pairs already parsed (parse_index shares them between entries)."""
    # Messages are built only on failure: this runs once per tensor per step
    # read (tens of thousands: issue 16).
    _need(isinstance(raw, dict), where, "tensor entry must be an object")
    name = _str(raw.get("name"), where, "name")
    w = f"{where}: tensor {name!r}"
    kind = _str(raw.get("kind"), w, "kind")
    if kind not in ("tensor", "ndarray"):
        _need(False, w, f"unknown kind {kind!r}")
    try:
        dtype = info_for_name(raw.get("dtype"))
    except Exception:
        raise CorruptStoreError(f"{w}: unknown dtype {raw.get('dtype')!r}") from None
    shape = _shape(raw.get("shape"), w, "shape")
    chunk = _shape(raw.get("chunk_shape"), w, "chunk_shape", positive=True)
    _need(len(chunk) == len(shape), w, "chunk_shape rank differs from shape")
    if math.prod(shape) > MAX_ELEMENTS:
        _need(False, w, f"absurd shape {list(shape)}")
    if math.prod(chunk) * dtype.itemsize > 1 << 34:
        _need(False, w, f"absurd chunk_shape {list(chunk)}")
    codec = _parse_codec(raw.get("codec"), codecs)
    array = _str(raw.get("array"), w, "array")
    parts = array.split("/")
    if not (parts[0] == TENSORS and len(parts) >= 3 and all(p not in ("", ".", "..") for p in parts)
            and _ARRAY_PATH_RE.match(array) is not None and parts[-1].startswith("@")):
        _need(False, w, f"unsafe array path {array!r}")
    entry = TensorEntry(name, kind, dtype, shape, chunk, codec, array, [], [], [], "", 0)
    n = entry.nchunks
    slots = raw.get("slots")
    if not (isinstance(slots, list) and len(slots) == n):
        _need(False, w, f"slots must list {n} chunk slots")
    entry.slots = [_int(s, w, "slot", hi=MAX_SLOTS - 1) for s in slots]
    crcs = raw.get("crcs")
    if not (isinstance(crcs, list) and len(crcs) == n):
        _need(False, w, f"crcs must list {n} chunk CRCs")
    entry.crcs = [_int(c, w, "crc", hi=0xFFFFFFFF) for c in crcs]
    shas = raw.get("sha256")
    if not (isinstance(shas, list) and len(shas) == n):
        _need(False, w, f"sha256 must list {n} entries")
    for d in shas:
        _need(d is None or (isinstance(d, str) and len(d) == 64), w, "sha256 must be null or 64 hex characters")
    entry.sha256 = shas
    entry.checksum = _str(raw.get("checksum"), w, "checksum")
    entry.written = _int(raw.get("written"), w, "written")
    if "delta" in raw:
        _parse_delta(entry, raw["delta"], w)
    if "pack" in raw:
        _parse_packs(entry, raw["pack"], w)
    return entry


def _parse_codec(raw: Any, seen: list[tuple[Any, CodecSpec]] | None) -> CodecSpec:
    """CodecSpec.from_codecs_json, reusing an equal chain parsed before."""
    if seen is not None:
        for chain, spec in seen:
            if chain == raw:
                return spec
    spec = CodecSpec.from_codecs_json(raw)
    if seen is not None and len(seen) < 16:
        seen.append((raw, spec))
    return spec


def _parse_packs(entry: TensorEntry, raw: Any, w: str) -> None:
    """The ``pack`` list of an entry with packed chunks (format version 3)."""
    n = entry.nchunks
    if not (isinstance(raw, list) and len(raw) == n):
        _need(False, w, f"pack must list {n} entries")
    packs: list[PackRange | None] = []
    for i, p in enumerate(raw):
        if p is None:
            packs.append(None)
            continue
        _need(isinstance(p, list) and len(p) == 4, w, "a pack entry must be [rank, n, offset, length]")
        _need(entry.keyframe(i) is None, w, "a packed chunk cannot be a delta")
        packs.append(PackRange(_int(p[0], w, "pack rank", hi=1 << 24), _int(p[1], w, "pack number", hi=1 << 32),
                               _int(p[2], w, "pack offset", hi=1 << 40), _int(p[3], w, "pack length", lo=4, hi=1 << 36)))
    entry.packs = packs


def _parse_delta(entry: TensorEntry, raw: Any, w: str) -> None:
    """The ``delta`` object of a delta-coded entry (format version 2)."""
    _need(isinstance(raw, dict), w, "delta must be an object")
    _need(entry.codec.blosc and entry.dtype.itemsize in DELTA_ITEMSIZES, w,
          f"delta coding of a {entry.dtype.logical} tensor with codec {entry.codec.tag}")
    _need(raw.get("array") == entry.array + DELTA_SUFFIX, w,
          f"delta array must be {entry.array + DELTA_SUFFIX!r}, got {raw.get('array')!r}")
    keys = raw.get("keyframes")
    n = entry.nchunks
    _need(isinstance(keys, list) and len(keys) == n, w, f"delta keyframes must list {n} entries")
    entry.keyframes = [None if k is None else _int(k, w, "keyframe slot", hi=MAX_SLOTS - 1) for k in keys]
    entry.delta_array = entry.array + DELTA_SUFFIX


def parse_index(data: bytes, where: str) -> tuple[list[TensorEntry], Any]:
    doc = decode_json(data, where)
    _need(isinstance(doc, dict), where, "index must be a JSON object")
    raw = doc.get("tensors")
    _need(isinstance(raw, list), where, "tensors must be a list")
    codecs: list[tuple[Any, CodecSpec]] = []
    entries = [parse_entry(r, where, codecs) for r in raw]
    names = [e.name for e in entries]
    _need(len(set(names)) == len(names), where, "duplicate tensor names")
    objects = doc.get("objects")
    check_tree_depth(objects, where)
    return entries, objects


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
