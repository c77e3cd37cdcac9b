"""Tensor entries of a step index (``tensors`` in index.json): build them on
write, validate them on read (torch-free format layer).

An entry is a JSON object (every format version) or, from format version 4,
a compact *row* of a packed one-chunk tensor (docs/format.md "Index rows")::

    [name, type, array, slot, crc, sha256 or null, written, rank, n, offset, length]

whose ``type`` indexes the index's ``types`` list of ``[kind, dtype, shape,
chunk_shape, codec]`` (``chunk_shape == shape``); its checksum is the
sha256 of its one CRC, as for any entry. 100,000 small tensors' objects
took ~20 us each to decode as JSON, rows ~1.5 (issue 16).

Readers trust nothing they read: every field is type- and bounds-checked
and a violation is a CorruptStoreError naming the tensor. Checks run as one
condition per entry on the common path; the messages are built only when
it fails.

>>> from dstt.format.dtypes import info_for_name
>>> from dstt.format.packs import PackRange
>>> e = TensorEntry("w", "tensor", info_for_name("float32"), (4,), (4,), CodecSpec(), "tensors/w/@f",
...                 [3], [7], [None], tensor_checksum([7]), 20, packs=[PackRange(0, 0, 0, 20)])
>>> types = TypeTable()
>>> row = entry_row(e, types)
>>> row
['w', 0, 'tensors/w/@f', 3, 7, None, 20, 0, 0, 0, 20]
>>> EntryParser(types.to_json(), "x", rows=True).entry(row) == e
True
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any, cast

from dstt.errors import CorruptStoreError
from dstt.format.codecs.delta import DELTA_ITEMSIZES
from dstt.format.codecs.spec import CodecSpec
from dstt.format.dtypes import DtypeInfo, info_for_name
from dstt.format.geometry import ChunkGrid, LogicalTensor
from dstt.format.layout import DELTA_SUFFIX, MAX_ARRAY_PATH, MAX_SLOTS, STATS_COLUMNS, TENSORS
from dstt.format.packs import PackRange
from dstt.format.predindex import PredInfo, parse_pred

#: What array paths written by dstt look like: ``tensors/<escaped name
#: components>/@<sig>`` in layout.escape_component's alphabet plus '@'; no
#: empty, '.' or '..' component. Anything else in an index is hostile.
_ARRAY_PATH_RE = re.compile(TENSORS + r"(?:/[A-Za-z0-9._%@-]+)+/@[A-Za-z0-9._%@-]*")

#: Upper bound on any stored tensor (elements); hostile shapes fail early.
MAX_ELEMENTS = 1 << 48
#: Upper bound on one chunk's raw bytes.
MAX_CHUNK_BYTES = 1 << 34
#: Values in an index row.
ROW_LEN = 11
_U32 = 0xFFFFFFFF


@dataclass
class TensorEntry(LogicalTensor):
    """One logical tensor of a committed step, as recorded in index.json:
    its layout (:class:`~dstt.format.geometry.LogicalTensor`) and where its
    chunks are."""

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
    #: Predictive coding (format version 5; docs/format.md "Predictive
    #: chunks", dstt/format/predindex.py): per chunk, how it was predicted,
    #: or None where it is stored whole. None for tensors never coded so.
    pred: PredInfo | None = None

    def keyframe(self, index: int) -> int | None:
        """The keyframe slot chunk ``index`` is coded against, None if stored whole."""
        return None if self.keyframes is None else self.keyframes[index]

    def pack(self, index: int) -> PackRange | None:
        """Where packed chunk ``index`` lives, None if it is a chunk file."""
        return None if self.packs is None else self.packs[index]

    @property
    def stats(self) -> dict[str, float]:
        """The tensor's stats row (STATS_COLUMNS -> value) once a reader has
        attached its step's stats (``set_stats_row``); {} before. Built on
        first use: most reads of a step never look at them."""
        got = self.__dict__.get("_stats")
        if got is None:
            row = self.__dict__.get("_stats_row")
            got = {} if row is None else dict(zip(STATS_COLUMNS, map(float, row)))
            self.__dict__["_stats"] = got
        return cast("dict[str, float]", got)

    @stats.setter
    def stats(self, value: dict[str, float]) -> None:
        self.__dict__["_stats"] = value

    def set_stats_row(self, row: Any) -> None:
        """Attach this tensor's row of its step's stats table (STATS_COLUMNS order)."""
        self.__dict__["_stats_row"] = row
        self.__dict__.pop("_stats", None)

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
            **({} if self.pred is None else {"pred": self.pred.to_json()}),
        }


@functools.lru_cache(maxsize=256)
def _codecs_json(codec: CodecSpec, itemsize: int) -> list[dict[str, Any]]:
    """codec.codecs_json, built once per (codec, itemsize): tens of thousands
    of entries per index share a few (issue 16). Read only: encoded at once."""
    return codec.codecs_json(itemsize)


def tensor_checksum(crcs: list[int]) -> str:
    """A tensor's checksum: sha256 of its chunk CRC-32Cs (uint32 LE, chunk order)."""
    if len(crcs) == 1:
        return hashlib.sha256(crcs[0].to_bytes(4, "little")).hexdigest()
    return hashlib.sha256(b"".join(c.to_bytes(4, "little") for c in crcs)).hexdigest()


# ----------------------------------------------------------------------------- rows (writing)


def is_row(e: TensorEntry) -> bool:
    """Whether ``e`` is written as an index row (format version 4): one
    whole chunk (``chunk_shape == shape``), packed, not delta coded."""
    packs = e.packs
    return (packs is not None and len(packs) == 1 and packs[0] is not None and e.keyframes is None
            and e.pred is None and e.chunk_shape == e.shape)


class TypeTable:
    """The ``types`` list an index's rows point into, built while writing."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, str, tuple[int, ...], CodecSpec], int] = {}
        self._rows: list[list[Any]] = []

    def id_of(self, e: TensorEntry) -> int:
        key = (e.kind, e.dtype.logical, e.shape, e.codec)
        got = self._ids.get(key)
        if got is None:
            got = self._ids[key] = len(self._rows)
            shape = list(e.shape)
            self._rows.append([e.kind, e.dtype.logical, shape, shape, _codecs_json(e.codec, e.dtype.itemsize)])
        return got

    def to_json(self) -> list[list[Any]]:
        return self._rows


def entry_row(e: TensorEntry, types: TypeTable) -> list[Any]:
    """The index row of an entry for which :func:`is_row` holds."""
    p = cast(PackRange, cast("list[PackRange | None]", e.packs)[0])
    return [e.name, types.id_of(e), e.array, e.slots[0], e.crcs[0], e.sha256[0], e.written,
            p.rank, p.n, p.offset, p.length]


# ----------------------------------------------------------------------------- validation helpers


def need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise CorruptStoreError(f"{where}: {what}")


def check_int(v: Any, where: str, what: str, lo: int = 0, hi: int | None = None) -> int:
    if type(v) is int and v >= lo and (hi is None or v <= hi):
        return v  # the common case, no message built (a bool is not of type int)
    need(isinstance(v, int) and not isinstance(v, bool), where, f"{what} must be an integer, got {type(v).__name__}")
    need(v >= lo and (hi is None or v <= hi), where, f"{what} {v} out of range")
    return cast('int', v)  # validated above


def check_str(v: Any, where: str, what: str) -> str:
    if type(v) is str:
        return v
    need(isinstance(v, str), where, f"{what} must be a string, got {type(v).__name__}")
    return cast('str', v)  # validated above


def check_shape(v: Any, where: str, what: str, positive: bool = False) -> tuple[int, ...]:
    if not (isinstance(v, list) and len(v) <= 32):
        need(False, where, f"{what} must be a list of at most 32 sizes")
    return tuple(check_int(x, where, what, lo=1 if positive else 0, hi=MAX_ELEMENTS) for x in v)


def _safe_array(array: Any) -> bool:
    return (type(array) is str and len(array) <= MAX_ARRAY_PATH and _ARRAY_PATH_RE.fullmatch(array) is not None
            and "/./" not in array and "/../" not in array)


def _sha_ok(d: Any) -> bool:
    return d is None or (type(d) is str and len(d) == 64)


# ----------------------------------------------------------------------------- parsing


#: Distinct codec chains one index may use before they stop being shared.
_MAX_SHARED_CODECS = 16


class EntryParser:
    """Validates the entries of one index, sharing what entries repeat
    (codec chains, dtypes, chunk grids of one shape) between them.
    ``types``: the index's ``types`` list (rows point into it); ``rows``:
    whether its format version allows rows."""

    def __init__(self, types: Any, where: str, *, rows: bool) -> None:
        self.where = where
        self.rows = rows
        self._codecs: list[tuple[Any, CodecSpec]] = []
        self._grids: dict[tuple[tuple[int, ...], tuple[int, ...]], ChunkGrid] = {}
        self._types: list[tuple[str, DtypeInfo, tuple[int, ...], CodecSpec, ChunkGrid]] = []
        if types is not None:
            need(rows, where, "types are only in indexes of format version 4")
            need(isinstance(types, list), where, "types must be a list")
            self._types = [self._type(t, i) for i, t in enumerate(types)]

    # -- shared pieces

    def _grid(self, shape: tuple[int, ...], chunk: tuple[int, ...]) -> ChunkGrid:
        key = (shape, chunk)
        g = self._grids.get(key)
        if g is None:
            g = self._grids[key] = ChunkGrid(shape, chunk)
        return g

    def _codec(self, raw: Any) -> CodecSpec:
        """CodecSpec.from_codecs_json, reusing an equal chain parsed before."""
        for chain, spec in self._codecs:
            if chain == raw:
                return spec
        spec = CodecSpec.from_codecs_json(raw)
        if len(self._codecs) < _MAX_SHARED_CODECS:
            self._codecs.append((raw, spec))
        return spec

    def _layout(self, raw: dict[str, Any] | list[Any], w: str
                ) -> tuple[str, DtypeInfo, tuple[int, ...], tuple[int, ...], CodecSpec]:
        """kind, dtype, shape, chunk_shape and codec of an entry or a type, validated."""
        get = raw.get if isinstance(raw, dict) else dict(zip(("kind", "dtype", "shape", "chunk_shape", "codec"), raw)).get
        kind = check_str(get("kind"), w, "kind")
        if kind not in ("tensor", "ndarray"):
            need(False, w, f"unknown kind {kind!r}")
        try:
            dtype = info_for_name(cast(str, get("dtype")))
        except Exception:
            raise CorruptStoreError(f"{w}: unknown dtype {get('dtype')!r}") from None
        shape = check_shape(get("shape"), w, "shape")
        chunk = check_shape(get("chunk_shape"), w, "chunk_shape", positive=True)
        need(len(chunk) == len(shape), w, "chunk_shape rank differs from shape")
        if math.prod(shape) > MAX_ELEMENTS:
            need(False, w, f"absurd shape {list(shape)}")
        if math.prod(chunk) * dtype.itemsize > MAX_CHUNK_BYTES:
            need(False, w, f"absurd chunk_shape {list(chunk)}")
        return kind, dtype, shape, chunk, self._codec(get("codec"))

    def _type(self, raw: Any, i: int) -> tuple[str, DtypeInfo, tuple[int, ...], CodecSpec, ChunkGrid]:
        w = f"{self.where}: type {i}"
        need(isinstance(raw, list) and len(raw) == 5, w, "a type must be [kind, dtype, shape, chunk_shape, codec]")
        kind, dtype, shape, chunk, codec = self._layout(raw, w)
        need(chunk == shape, w, "a row type's chunk_shape must equal its shape (one whole chunk)")
        return kind, dtype, shape, codec, self._grid(shape, chunk)

    # -- entries

    def entry(self, raw: Any) -> TensorEntry:
        """One entry (an object, or a row where allowed), validated."""
        if type(raw) is list:
            return self._row(raw)
        return self._object(raw)

    def _row(self, r: list[Any]) -> TensorEntry:
        # One condition checks the whole row on the common path;
        # _row_problem names what is wrong otherwise.
        types = self._types
        if not (self.rows and len(r) == ROW_LEN):
            self._row_problem(r)
        name, t, array, slot, crc, sha, written, rank, n, off, length = r
        if not (type(name) is str and type(t) is int and 0 <= t < len(types) and _safe_array(array)
                and type(slot) is int and 0 <= slot < MAX_SLOTS and type(crc) is int and 0 <= crc <= _U32
                and (sha is None or (type(sha) is str and len(sha) == 64)) and type(written) is int and written >= 0
                and type(rank) is int and 0 <= rank <= 1 << 24 and type(n) is int and 0 <= n <= 1 << 32
                and type(off) is int and 0 <= off <= 1 << 40 and type(length) is int and 4 <= length <= 1 << 36):
            self._row_problem(r)
        kind, dtype, shape, codec, grid = types[t]
        e = TensorEntry(name, kind, dtype, shape, shape, codec, array, [slot], [crc], [sha],
                        hashlib.sha256(crc.to_bytes(4, "little")).hexdigest(), written,
                        None, None, [PackRange(rank, n, off, length)])
        e.share_grid(grid)
        return e

    def _row_problem(self, r: list[Any]) -> None:
        """Raise the CorruptStoreError that says what is wrong with row ``r``."""
        where = self.where
        need(self.rows, where, "index rows are only in indexes of format version 4")
        need(len(r) == ROW_LEN, where, "an index row must be [name, type, array, slot, crc, sha256, written, "
             "rank, n, offset, length]")
        name = check_str(r[0], where, "name")
        w = f"{where}: tensor {name!r}"
        check_int(r[1], w, "type", hi=len(self._types) - 1)
        need(_safe_array(r[2]), w, f"unsafe array path {r[2]!r}")
        check_int(r[3], w, "slot", hi=MAX_SLOTS - 1)
        check_int(r[4], w, "crc", hi=_U32)
        need(_sha_ok(r[5]), w, "sha256 must be null or 64 hex characters")
        check_int(r[6], w, "written")
        check_int(r[7], w, "pack rank", hi=1 << 24)
        check_int(r[8], w, "pack number", hi=1 << 32)
        check_int(r[9], w, "pack offset", hi=1 << 40)
        check_int(r[10], w, "pack length", lo=4, hi=1 << 36)
        need(False, w, "malformed index row")  # (not reached: one of the above failed)

    def _object(self, raw: Any) -> TensorEntry:
        where = self.where
        need(isinstance(raw, dict), where, "tensor entry must be an object")
        name = check_str(raw.get("name"), where, "name")
        w = f"{where}: tensor {name!r}"
        kind, dtype, shape, chunk, codec = self._layout(raw, w)
        array = raw.get("array")
        if not _safe_array(array):
            check_str(array, w, "array")
            need(False, w, f"unsafe array path {array!r}")
        grid = self._grid(shape, chunk)
        n = grid.nchunks
        slots = raw.get("slots")
        if not (isinstance(slots, list) and len(slots) == n):
            need(False, w, f"slots must list {n} chunk slots")
        crcs = raw.get("crcs")
        if not (isinstance(crcs, list) and len(crcs) == n):
            need(False, w, f"crcs must list {n} chunk CRCs")
        shas = raw.get("sha256")
        if not (isinstance(shas, list) and len(shas) == n):
            need(False, w, f"sha256 must list {n} entries")
        if not all(_sha_ok(d) for d in shas):
            need(False, w, "sha256 must be null or 64 hex characters")
        entry = TensorEntry(name, kind, dtype, shape, chunk, codec, array,
                            [check_int(s, w, "slot", hi=MAX_SLOTS - 1) for s in slots],
                            [check_int(c, w, "crc", hi=_U32) for c in crcs], shas,
                            check_str(raw.get("checksum"), w, "checksum"), check_int(raw.get("written"), w, "written"))
        entry.share_grid(grid)
        if "delta" in raw:
            _parse_delta(entry, raw["delta"], w)
        if "pred" in raw:
            need("delta" not in raw, w, "an entry is delta coded or predictively coded, not both")
            entry.pred = parse_pred(raw["pred"], w, name=name, array=array, dtype=dtype.logical, nchunks=n,
                                    itemsize=dtype.itemsize, step=None, blosc=codec.blosc)
            entry.delta_array = entry.pred.array
        if "pack" in raw:
            _parse_packs(entry, raw["pack"], w)
        return entry


def parse_entry(raw: Any, where: str) -> TensorEntry:
    """One tensor entry object of an index, validated (parse_index shares
    the work of many with one :class:`EntryParser`)."""
    return EntryParser(None, where, rows=False).entry(raw)


def _parse_packs(entry: TensorEntry, raw: Any, w: str) -> None:
    """The ``pack`` list of an entry with packed chunks (format version 3)."""
    n = entry.nchunks
    if not (isinstance(raw, list) and len(raw) == n):
        need(False, w, f"pack must list {n} entries")
    packs: list[PackRange | None] = []
    for i, p in enumerate(raw):
        if p is None:
            packs.append(None)
            continue
        need(isinstance(p, list) and len(p) == 4, w, "a pack entry must be [rank, n, offset, length]")
        need(entry.keyframe(i) is None, w, "a packed chunk cannot be a delta")
        packs.append(PackRange(check_int(p[0], w, "pack rank", hi=1 << 24), check_int(p[1], w, "pack number", hi=1 << 32),
                               check_int(p[2], w, "pack offset", hi=1 << 40),
                               check_int(p[3], w, "pack length", lo=4, hi=1 << 36)))
    entry.packs = packs


def _parse_delta(entry: TensorEntry, raw: Any, w: str) -> None:
    """The ``delta`` object of a delta-coded entry (format version 2)."""
    need(isinstance(raw, dict), w, "delta must be an object")
    need(entry.codec.blosc and entry.dtype.itemsize in DELTA_ITEMSIZES, w,
         f"delta coding of a {entry.dtype.logical} tensor with codec {entry.codec.tag}")
    need(raw.get("array") == entry.array + DELTA_SUFFIX, w,
         f"delta array must be {entry.array + DELTA_SUFFIX!r}, got {raw.get('array')!r}")
    keys = raw.get("keyframes")
    n = entry.nchunks
    need(isinstance(keys, list) and len(keys) == n, w, f"delta keyframes must list {n} entries")
    entry.keyframes = [None if k is None else check_int(k, w, "keyframe slot", hi=MAX_SLOTS - 1) for k in keys]
    entry.delta_array = entry.array + DELTA_SUFFIX
