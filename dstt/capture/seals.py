"""Seal records of the staging ring (ring.py): what a sealed step's record
holds, how it is encoded by the trainer and read back -- by the capture
helper at every step, by recovery after a crash.

A record names the step, its plan (layouts, value tree, meta arrays, each
task's chunk) and where each chunk's bytes are in the pool file. Three
formats are read; the third is written:

1. one JSON object per task (``tasks``: a list of dicts with start, nbytes
   and CRC-32C of its bytes);
2. what stays the same while the state keeps its layout (``static``: the
   layouts, meta arrays and each task's chunk) apart from what changes each
   step (per task: start, nbytes, CRC), each part's JSON encoded and decoded
   once while unchanged;
3. as 2, but the pool bytes are described by *extents*: runs of tasks
   staged back to back (a group copied into one pool block, or one task),
   each with its start, the CRC-32C of its bytes and the positions of its
   tasks in the plan (each task's bytes follow the previous one's, its size
   from its static shape and dtype): one CRC per group block, no view per
   task (issue 16). Every byte of every task is covered by exactly one
   CRC'd extent: a step whose bytes changed after its seal is detected
   (:class:`StaleSeal`);
4. as 3, with the record's own CRC-32Cs (issue 23): ``record_crc`` covers
   the head up to it and the value tree's text, ``static_crc`` the static
   part's (a format-3 record's CRCs cover only the pool bytes).

A record read back is untrusted: :func:`read_record` raises :class:`CorruptRing`
for anything that is not one (never another exception, whatever the bytes),
and recovery checks every field before using it (sealcheck.py); the step's
plan is rebuilt from it by sealplan.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import google_crc32c
import numpy as np
import torch

from dstt.errors import CaptureError
from dstt.format import replicas as RP
from dstt.format.geometry import TensorLayout
from dstt.store.plan import ChunkTask, StepPlan, changed_positions

SEAL_FORMAT = "dstt-ring-seal"
#: The format :func:`seal_record` writes (see the module docstring).
SEAL_VERSION = 4


class CorruptRing(Exception):
    """A ring left behind does not check out: it is discarded, never committed."""


class StaleSeal(CorruptRing):
    """One sealed step's bytes changed since it was sealed (its blocks were
    reused after its commit failed): that step is skipped, never committed."""


def seal_record(plan: StepPlan, pool_name: str, pool: torch.Tensor, staged: list[tuple[ChunkTask, torch.Tensor]],
                crc: bool = True, groups: list[tuple[Any, torch.Tensor]] | tuple[()] = ()) -> dict[str, Any]:
    """The record of a step whose chunks are all in ``pool``: ``staged``,
    tasks each with its own pool view, and ``groups``, ``(group, block)``
    pairs whose ``group.tasks`` lie back to back from the block's start
    (stager.StagedGroup: no view per task). ``crc=False``: no CRC (a pass
    over the step) -- for a writer that removes a step's seal before its
    memory is reused (the flight recorder's slots), so a seal never
    outlives its bytes; recovery then commits the chunks as they are.

    Format 3 (see the module docstring); :func:`encode_record` writes it
    and :func:`read_record` reads it. ``static``, the part unchanged while
    the state keeps its layout, is one object reused step after step."""
    static = _static_of(plan)
    where = _positions(plan)
    base = pool.data_ptr()
    whole = pool.numpy()  # (one array of the pool: a slice of it per extent, no tensor per chunk)
    extend = google_crc32c.extend
    extents: list[list[Any]] = []
    # (a chunk held as a replica of another rank's always gets its CRC: a
    # lost rank's step is rebuilt from it, checked -- capture/replicaguard.py)
    held = len(plan.tasks) - plan.replicas if plan.replicas else None
    try:
        for g, block in groups:
            start = block.data_ptr() - base
            if not 0 <= start <= whole.size - g.nbytes:
                raise IndexError
            positions = _group_positions(g, plan.layout_token, where)
            summed = crc or (held is not None and max(positions, default=-1) >= held)
            extents.append([start, extend(0, whole[start:start + g.nbytes]) if summed else None, positions])
        for t, v in staged:
            start = v.data_ptr() - base
            if not 0 <= start <= whole.size - v.nbytes:
                raise IndexError
            p = where[id(t)]
            summed = crc or (held is not None and p >= held)
            extents.append([start, extend(0, whole[start:start + v.nbytes]) if summed else None, [p]])
    except (KeyError, IndexError):  # (IndexError: a block past a reservation that ended short, reserve.py)
        raise CaptureError(f"step {plan.step}: a staged chunk is not in its plan or not in the pool file "
                           f"{pool_name}") from None
    n = len(plan.tasks)
    covered = set().union(*(e[2] for e in extents))
    if len(covered) != n or sum(len(e[2]) for e in extents) != n:
        raise CaptureError(f"step {plan.step}: {len(covered)} chunks staged for {n} planned")
    return {"format": SEAL_FORMAT, "version": SEAL_VERSION, "step": plan.step, "seq": plan.seq, "pool": pool_name,
            "tree": plan.tree, "layouts": static["layouts"], "meta": static["meta"],
            "tasks": {"static": static["tasks"], "extents": extents}, "_static": static}


#: (layout token, task list, {id(task): its position}) of the last plan
#: sealed (kept alive: a later plan of the very same token is laid out
#: alike, its tasks the same objects but where changed_positions says).
_POSITIONS: tuple[object, list[ChunkTask], dict[int, int]] | None = None
#: By id of a group: (the group, the plan's layout token, its tasks'
#: positions in the plan's task list, their JSON text) -- a group staged
#: step after step while the plan is reused (both kept alive, so their ids
#: are not reused; a group's tasks sit at the same positions in every plan
#: of one token).
_GROUP_POSITIONS: dict[int, tuple[Any, object, list[int], str]] = {}
#: The JSON text of the positions lists in _GROUP_POSITIONS, by their id.
_POSITIONS_TEXT: dict[int, tuple[list[int], str]] = {}


def _group_positions(g: Any, token: object, where: dict[int, int]) -> list[int]:
    """The positions of ``g.tasks`` in the task list of a plan of layout
    token ``token`` (read-only: shared by the records of the steps that
    stage this group for plans of this token)."""
    got = _GROUP_POSITIONS.get(id(g))
    if got is not None and got[0] is g and got[1] is token:
        return got[2]
    positions = [where[id(t)] for t in g.tasks]
    if len(_GROUP_POSITIONS) >= 256:
        _GROUP_POSITIONS.clear()
        _POSITIONS_TEXT.clear()
    text = json.dumps(positions)
    _GROUP_POSITIONS[id(g)] = (g, token, positions, text)
    _POSITIONS_TEXT[id(positions)] = (positions, text)
    return positions


def _extents_text(extents: list[list[Any]]) -> str:
    """``json.dumps(extents)``, the positions of groups staged before not
    encoded again."""
    parts = []
    for start, crc, positions in extents:
        got = _POSITIONS_TEXT.get(id(positions))
        text = got[1] if got is not None and got[0] is positions else json.dumps(positions)
        parts.append(f"[{int(start)}, {'null' if crc is None else int(crc)}, {text}]")
    return "[" + ", ".join(parts) + "]"


def _positions(plan: StepPlan) -> dict[int, int]:
    """{id(task): its position} of ``plan``'s tasks (read-only); for a plan
    of the last one's layout token, that one's with the changed tasks'
    entries replaced (no Python pass over the unchanged ones)."""
    global _POSITIONS
    last, tasks, token = _POSITIONS, plan.tasks, plan.layout_token
    if last is not None and last[0] is token:
        if last[1] is tasks:
            return last[2]
        if len(last[1]) == len(tasks):
            old = last[1]
            where = dict(last[2])
            for i in changed_positions(old, tasks):
                del where[id(old[i])]
                where[id(tasks[i])] = i
            _POSITIONS = (token, tasks, where)
            return where
    where = {id(t): i for i, t in enumerate(tasks)}
    _POSITIONS = (token, tasks, where)
    return where


#: The static part of the last sealed plans (see seal_record), keyed by the
#: identity of their layouts (a layout is never changed once built, and
#: the key's layouts are kept alive here, so their ids are not reused).
_STATIC: dict[tuple[int, ...], tuple[list[TensorLayout], list[tuple[TensorLayout, int]], dict[str, Any]]] = {}
_STATIC_MAX = 8
#: (layout token, layouts, meta_arrays, static) of the last plan sealed:
#: kept alive, so a later plan of the very same token and lists is that
#: plan's layout (StepPlan.layout_key).
_LAST_STATIC: tuple[object, list[TensorLayout], list[TensorLayout], dict[str, Any]] | None = None


def _static_of(plan: StepPlan) -> dict[str, Any]:
    """The unchanging part of ``plan``'s seal record: the same object for
    plans with the same layouts and tasks (a capture's steps, as long as its
    state keeps its layout)."""
    global _LAST_STATIC
    last = _LAST_STATIC
    if last is not None and last[0] is plan.layout_token and last[1] is plan.layouts and last[2] is plan.meta_arrays:
        return last[3]  # a plan reused (planlocal.StepMemo): laid out as the last, its lists never changed
    key = tuple(map(id, plan.layouts)) + (-1,) + tuple(map(id, plan.meta_arrays)) + (-2, plan.replicas)
    got = _STATIC.get(key)
    if got is not None and len(got[1]) == len(plan.tasks) and all(
            t.layout is l and t.index == i for t, (l, i) in zip(plan.tasks, got[1])):
        _LAST_STATIC = (plan.layout_token, plan.layouts, plan.meta_arrays, got[2])
        return got[2]
    index = {id(l): i for i, l in enumerate(plan.layouts)}
    entries: list[list[Any]] = [[index[id(t.layout)], t.index, list(t.coords), list(t.offset), list(t.shape),
                                 _dtype_name(t.source.dtype)] for t in plan.tasks]
    static = {
        "layouts": [_layout_doc(l) for l in plan.layouts],
        "meta": [index[id(l)] for l in plan.meta_arrays],
        "tasks": entries,
    }
    if plan.replicas:  # held as a replica: [owner, shard] (dstt.format.replicas)
        for entry, t in zip(entries[-plan.replicas:], plan.tasks[-plan.replicas:]):
            entry.append(RP.marker(t.layout, t.index, t.offset))
    if len(_STATIC) >= _STATIC_MAX:
        _STATIC.clear()
    _STATIC[key] = (list(plan.layouts) + list(plan.meta_arrays), [(t.layout, t.index) for t in plan.tasks], static)
    _LAST_STATIC = (plan.layout_token, plan.layouts, plan.meta_arrays, static)
    return static


#: Layout documents, memoized: a capture seals the same layouts step after
#: step (tens of thousands of tensors: issue 16). Keyed by the layout object
#: (kept alive with its document, so its id is not reused); cleared when
#: full. (The layouts rebuilt from them: sealplan.py.)
_DOCS: dict[int, tuple[TensorLayout, dict[str, Any]]] = {}
_MEMO_MAX = 1 << 17


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


class _TextCache:
    """The JSON text of the last few objects encoded (by identity, kept
    alive: equality would not do, ``1 == 1.0 == True`` encode differently)
    and the objects the last few texts decoded to: what repeats from one
    seal record to the next is encoded and decoded once."""

    def __init__(self) -> None:
        self.texts: list[tuple[Any, bytes]] = []  # (object, its JSON), newest last
        self.parsed: list[tuple[bytes, Any]] = []  # (JSON bytes, the object), newest last

    def encode(self, obj: Any) -> bytes:
        for o, text in self.texts:
            if o is obj:
                return text
        text = json.dumps(obj, allow_nan=False).encode()
        self.texts = [*self.texts[-3:], (obj, text)]
        return text

    def decode(self, data: bytes) -> Any:
        for raw, obj in self.parsed:
            if raw == data:
                return obj
        obj = json.loads(data)
        self.parsed = [*self.parsed[-3:], (bytes(data), obj)]
        return obj


class _TreeText:
    """The JSON text of value trees, exactly as ``json.dumps`` writes it,
    reusing the text of each dict and list shared -- by identity -- with
    the last tree encoded (plan.py hands each step a new tree, but the
    subtrees that did not change are the previous step's objects: a 12 ms
    loop re-encoded ~5 KB of JSON per step, ~40 us of the trainer's
    background Python). Sound because a plan's tree is read-only once built
    (plan.py reuses those subtrees on the same grounds); the memo keeps the
    objects it names alive, so an id is never another object's.

    A container none of whose children the last tree had is encoded by
    json.dumps whole (in C: a tree that shares nothing costs what
    json.dumps costs); its child containers are remembered without text,
    and one met again gets its text then, kept from then on."""

    def __init__(self) -> None:
        #: id -> (container, its text or None: seen once, as the child of one encoded whole)
        self.memo: dict[int, tuple[Any, str | None]] = {}

    def encode(self, tree: Any) -> bytes:
        fresh: dict[int, tuple[Any, str | None]] = {}
        text = self._text(tree, fresh)
        self.memo = fresh  # (the containers of this tree only: earlier trees' are let go)
        return text.encode()

    def _text(self, node: Any, fresh: dict[int, tuple[Any, str | None]]) -> str:
        """``node``'s JSON text; the containers it is made of go to ``fresh``."""
        kind = type(node)
        if kind is str:
            return _quote(node)
        if kind is dict or kind is list:
            memo = self.memo
            got = memo.get(id(node))  # (an id in the memo is its object's: the memo keeps them alive)
            if got is not None and got[1] is not None:
                fresh[id(node)] = got
                return got[1]
            children = node if kind is list else node.values()
            if got is None and any([id(x) in memo for x in children]) and (
                    kind is list or all(type(k) is str for k in node)):
                if kind is list:
                    text = "[" + ", ".join([self._text(x, fresh) for x in node]) + "]"
                else:
                    text = "{" + ", ".join([f"{_quote(k)}: {self._text(v, fresh)}" for k, v in node.items()]) + "}"
            else:
                text = json.dumps(node, allow_nan=False)  # (in C; keys json turns into strings too)
                if got is None:
                    for x in children:
                        if type(x) is dict or type(x) is list:
                            fresh[id(x)] = (x, None)
            fresh[id(node)] = (node, text)
            return text
        if kind is int:
            return int.__repr__(node)
        if node is None:
            return "null"
        if kind is bool:
            return "true" if node else "false"
        if kind is float and math.isfinite(node):
            return float.__repr__(node)
        return json.dumps(node, allow_nan=False)  # (NaN and infinities refused) anything else json takes


#: What json.dumps quotes strings with (its C function where there is one).
_quote: Callable[[str], str] = (getattr(json.encoder, "c_encode_basestring_ascii", None)
                                or json.encoder.encode_basestring_ascii)
_TREE_TEXT = _TreeText()
_TREES = _TextCache()
_STATICS = _TextCache()
_SEP_TREE = b', "tree": '
_SEP_STATIC = b', "static": '


def encode_record(record: dict[str, Any]) -> bytes:
    """``record`` (from :func:`seal_record`) as one JSON document: first what
    changes every step, then the tree and the static part, whose texts are
    reused from earlier records while they are unchanged. :func:`read_record`
    reads it back (any JSON parser reads it too)."""
    version = record.get("version")
    if version not in (2, 3, 4):  # (a record of the first format: written as it is)
        return json.dumps({k: v for k, v in record.items() if not k.startswith("_")}, allow_nan=False).encode()
    static = record.get("_static")
    if static is None:
        static = {"layouts": record["layouts"], "meta": record["meta"], "tasks": record["tasks"]["static"]}
    tasks = record["tasks"]
    tree_text = _TREE_TEXT.encode(record["tree"])
    static_text = _STATICS.encode(static)
    if version in (3, 4):  # (written as json.dumps would, without its encoder's set-up per call)
        head_text = (f'{{"format": "{SEAL_FORMAT}", "version": {version:d}, "step": {record["step"]:d}, '
                     f'"seq": {record["seq"]:d}, "pool": {_quote(record["pool"])}, '
                     f'"tree_bytes": {len(tree_text):d}, "static_bytes": {len(static_text):d}, '
                     f'"extents": {_extents_text(tasks["extents"])}')
        if version == 4:
            head = f'{head_text}, "static_crc": {_static_crc(static_text):d}'.encode()
            crc = google_crc32c.extend(google_crc32c.extend(0, head), tree_text)
            return b"".join([head, b', "record_crc": %d' % crc, _SEP_TREE, tree_text, _SEP_STATIC, static_text,
                             b"}"])
    else:
        fields = {"format": SEAL_FORMAT, "version": version, "step": record["step"], "seq": record["seq"],
                  "pool": record["pool"], "start": tasks["start"], "nbytes": tasks["nbytes"], "crc": tasks["crc"],
                  "tree_bytes": len(tree_text), "static_bytes": len(static_text)}
        head_text = json.dumps(fields, allow_nan=False)[:-1]
    return b"".join([head_text.encode(), _SEP_TREE, tree_text, _SEP_STATIC, static_text, b"}"])


#: The per-step fields of a record's head, by format: moved under ``tasks``.
_STEP_FIELDS = {2: ("start", "nbytes", "crc"), 3: ("extents",), 4: ("extents",)}
_SEP_CRC = b', "record_crc": '
#: (static part's text, its CRC-32C) of the last record encoded.
_LAST_STATIC_CRC: tuple[bytes, int] = (b"", 0)


def _static_crc(text: bytes) -> int:
    global _LAST_STATIC_CRC
    last = _LAST_STATIC_CRC
    if last[0] is text:  # (the text cache hands out the same bytes while the static part is unchanged)
        return last[1]
    crc = int(google_crc32c.value(text))
    _LAST_STATIC_CRC = (text, crc)
    return crc


def read_record(data: bytes) -> dict[str, Any]:
    """A seal record (any format) from its bytes, as :func:`seal_record`
    made it: ``step``, ``seq``, ``pool``, ``tree``, ``layouts``, ``meta``
    and ``tasks`` (a list of dicts in the first format), its record CRCs
    checked (format 4). Parts unchanged since the last records read are
    not decoded again (read-only objects, shared). CorruptRing -- and no
    other exception, whatever the bytes -- if it is not one; what it
    holds is checked by sealcheck.check_record."""
    try:
        fast = _read_fast(data)
        if fast is not None:
            return fast
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != SEAL_FORMAT:
            raise CorruptRing("not a seal record")
        if "record_crc" in doc or (type(doc.get("version")) is int and doc["version"] >= 4):
            raise CorruptRing("its record CRC cannot be checked: not laid out as written")
        fields = _STEP_FIELDS.get(doc.get("version"))  # type: ignore[arg-type]
        if fields is not None:
            static = doc["static"]
            if not isinstance(static, dict):
                raise CorruptRing("bad static part")
            doc = {**doc, "layouts": static["layouts"], "meta": static["meta"],
                   "tasks": {"static": static["tasks"], **{k: doc[k] for k in fields}}}
        return doc
    except CorruptRing:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError, OverflowError) as e:
        raise CorruptRing(f"not a seal record ({type(e).__name__}: {str(e)[:200]})") from None


def _read_fast(data: bytes) -> dict[str, Any] | None:
    """The fast path of :func:`read_record` for a record encode_record wrote
    (format 2 or later); None for anything else (read the slow way)."""
    i = data.find(_SEP_TREE)
    if i < 0:
        return None
    try:
        head = json.loads(data[:i] + b"}")
    except (ValueError, RecursionError):
        return None
    if not isinstance(head, dict) or head.get("format") != SEAL_FORMAT:
        return None
    fields = _STEP_FIELDS.get(head.get("version"))  # type: ignore[arg-type]
    if fields is None:
        return None
    nt, ns = head.get("tree_bytes"), head.get("static_bytes")
    if not isinstance(nt, int) or not isinstance(ns, int) or nt < 0 or ns < 0:
        return None
    a = i + len(_SEP_TREE)
    b = a + nt
    c = b + len(_SEP_STATIC)
    if data[b:c] != _SEP_STATIC or c + ns + 1 != len(data) or data[-1:] != b"}":
        return None
    if head["version"] >= 4 or "record_crc" in head:
        _check_crcs(data, head, i, (a, b), (c, c + ns))
    tree = _TREES.decode(data[a:b])
    static = _STATICS.decode(data[c:c + ns])
    if not isinstance(static, dict):
        raise CorruptRing("bad static part")
    head["tree"] = tree
    head["layouts"], head["meta"] = static["layouts"], static["meta"]
    head["tasks"] = {"static": static["tasks"], **{k: head.pop(k, None) for k in fields}}
    return head


def _check_crcs(data: bytes, head: dict[str, Any], end: int, tree: tuple[int, int], static: tuple[int, int]
                ) -> None:
    """CorruptRing unless the record CRC (head and tree) and the static
    part's CRC of a format-4 record match."""
    want, want_static = head.pop("record_crc", None), head.pop("static_crc", None)
    j = data.rfind(_SEP_CRC, 0, end)
    if type(want) is not int or type(want_static) is not int or j < 0:
        raise CorruptRing("its record CRCs are missing")
    view = np.frombuffer(data, np.uint8)  # (slices without copies)
    got = google_crc32c.extend(google_crc32c.extend(0, view[:j]), view[tree[0]:tree[1]])
    if got != want or google_crc32c.value(view[static[0]:static[1]]) != want_static:
        raise CorruptRing("it does not match its record CRC (changed after it was written)")


def _layout_doc(l: TensorLayout) -> dict[str, Any]:
    got = _DOCS.get(id(l))
    if got is not None and got[0] is l:
        return got[1]
    doc = _make_layout_doc(l)
    if len(_DOCS) >= _MEMO_MAX:
        _DOCS.clear()
    _DOCS[id(l)] = (l, doc)
    return doc


def _make_layout_doc(l: TensorLayout) -> dict[str, Any]:
    return {"name": l.name, "kind": l.kind, "dtype": l.dtype.logical, "shape": list(l.shape),
            "chunk_shape": list(l.chunk_shape),
            # ("auto" is a writer's choice per step, not a layout's: its layouts are predictive ones)
            "compression": "predictive" if l.codec.compression == "auto" else l.codec.compression,
            "level": l.codec.level,
            "regions": [[list(r.offset), list(r.shape), list(r.holders)] for r in l.regions],
            "pack_chunk_bytes": l.pack_chunk_bytes}


__all__ = ["SEAL_FORMAT", "SEAL_VERSION", "CorruptRing", "StaleSeal", "encode_record", "read_record",
           "seal_record"]
