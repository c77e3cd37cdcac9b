"""Rank records: a rank's part of a step, recorded in the store
(torch-free format layer). What :mod:`dstt.capture.ranks` writes and reads
to commit a step under torch.distributed without the trainers' process
group (issue 12): each rank's capture helper records its chunks of a step
once they are durable; rank 0's helper commits the step from the records.

A record, in the step's directory::

    meta/steps/<branch>/<step:020d>/rank-<rank:05d>.json
        {"format": "dstt-rank-record", "run": "<capture run id>", "branch": ..., "step": k,
         "seq": s, "rank": r, "world": W, "error": null | "why",
         "results": [[name, index, crc, sha256 hex | null, slot, written, nbytes, partial,
                      keyframe, pack], ...],
         "plan": {...}}          # rank 0 only: layouts and value tree (a seal record's form)

and rank 0's note that a step will not be committed, beside them::

    meta/steps/<branch>/<step:020d>/rank-fail.json   {"run": ..., "seq": s, "error": "why"}

A record names the capture run (``run``) and the step's sequence number
(``seq``), so a record left by another run of the same branch is never
combined with this one's. Records of a step that is never committed lie in
an uncommitted step directory: ``dstt gc`` removes them with it. A record is
read from the store: untrusted, bounded, validated (:func:`read_record`,
:func:`decode_result`).

>>> r = ChunkResult("model/w", 0, 7, None, 3, 12, 16, [4.0, 1.5, 1.0, 10.0, 1.0, 2.0, 0, float("nan")])
>>> row = encode_result(r); row[:7], row[7][-1]
(['model/w', 0, 7, None, 3, 12, 16], 'nan')
>>> decode_result(row, "x").partial[:2], record_key("main", 5, 1)
([4.0, 1.5], 'meta/steps/main/00000000000000000005/rank-00001.json')
"""

from __future__ import annotations

import json
import math
import typing
from dataclasses import fields
from typing import Any

from dstt.errors import CorruptStoreError
from dstt.format import layout as L
from dstt.format.backends import Backend
from dstt.format.codecs.predictors import Coding
from dstt.format.commit import ChunkResult
from dstt.format.manifest import parse_commit
from dstt.format.predindex import ChunkPred

RECORD_FORMAT = "dstt-rank-record"
FAIL_FILE = "rank-fail.json"
#: A record is ~200 bytes per chunk; anything bigger is not ours.
RECORD_MAX_BYTES = 256 << 20
#: Ranks a record may name (a hostile record must not make rank 0 read forever).
MAX_WORLD = 1 << 20
#: A fail note is a short document (its error text is cut at 4000 characters).
FAIL_MAX_BYTES = 1 << 16


def record_key(branch: str, step: int, rank: int) -> str:
    """``meta/steps/<branch>/<step>/rank-<rank:05d>.json``."""
    return f"{L.step_dir(branch, step)}/rank-{rank:05d}.json"


def fail_key(branch: str, step: int) -> str:
    return f"{L.step_dir(branch, step)}/{FAIL_FILE}"


# ----------------------------------------------------------------------------- (de)coding

_FIELDS = [f.name for f in fields(ChunkResult) if f.name != "pending"]


def encode_result(r: ChunkResult) -> list[Any]:
    """A settled ChunkResult as a JSON list (field order of the dataclass)."""
    out: list[Any] = []
    for name in _FIELDS:
        v = getattr(r, name)
        if isinstance(v, bytes):
            v = v.hex()
        elif name == "coding" and v is not None:  # a predictive chunk's coding (predictors.Coding)
            v = v.to_json()
        elif isinstance(v, tuple):  # a NamedTuple of ints (packs.PackRange)
            v = list(v)
        elif name == "partial":
            v = [x if math.isfinite(x) else repr(x) for x in v]  # strict JSON: inf/nan as text
        out.append(v)
    return out


def decode_result(row: Any, where: str) -> ChunkResult:
    """The inverse of :func:`encode_result`, validated (a record is untrusted)."""
    if not isinstance(row, list) or len(row) != len(_FIELDS):
        raise CorruptStoreError(f"{where}: a chunk result must be a list of {len(_FIELDS)} values")
    hints = typing.get_type_hints(ChunkResult)
    kw: dict[str, Any] = {}
    for name, v in zip(_FIELDS, row):
        if name == "sha256":
            kw[name] = None if v is None else bytes.fromhex(str(v))
        elif name == "coding":
            kw[name] = None if v is None else Coding.from_json(v, where)
        elif name == "pred" and v is not None:
            if not (isinstance(v, list) and len(v) == 3 and all(type(x) is int and x >= 0 for x in v)):
                raise CorruptStoreError(f"{where}: bad pred record")
            kw[name] = ChunkPred(*v)
        elif name == "partial":
            if not isinstance(v, list):
                raise CorruptStoreError(f"{where}: bad partial stats")
            kw[name] = [float(x) for x in v]
        elif v is None or isinstance(v, (int, str)) and not isinstance(v, bool):
            kw[name] = v
        elif isinstance(v, list):  # a NamedTuple field: its class from the annotation
            cls = next(a for a in typing.get_args(hints[name]) if a is not type(None))
            kw[name] = cls(*(int(x) for x in v))
        else:
            raise CorruptStoreError(f"{where}: bad value for {name}")
    for name in ("index", "crc", "slot", "written", "nbytes"):
        if not isinstance(kw[name], int):
            raise CorruptStoreError(f"{where}: {name} must be an integer")
    return ChunkResult(**kw)


def plan_doc(record: dict[str, Any]) -> dict[str, Any]:
    """What rank 0's record keeps of its seal record to commit without it."""
    return {k: record[k] for k in ("step", "seq", "tree", "layouts", "meta")} | {"tasks": [], "pool": ""}


# ----------------------------------------------------------------------------- records


def write_record(backend: Backend, branch: str, step: int, seq: int, run: str, rank: int, world: int, *,
                 results: list[ChunkResult] | None = None, error: str | None = None,
                 plan: dict[str, Any] | None = None) -> None:
    """Record this rank's part of ``step`` as durable (or failed: ``error``)."""
    doc = {"format": RECORD_FORMAT, "run": run, "branch": branch, "step": step, "seq": seq, "rank": rank,
           "world": world, "error": error,
           "results": [encode_result(r) for r in results or []], "plan": plan}
    backend.put_atomic(record_key(branch, step, rank), json.dumps(doc, allow_nan=False).encode())


def write_fail(backend: Backend, branch: str, step: int, seq: int, run: str, error: str) -> None:
    """Rank 0: ``step`` of ``run`` will not be committed (the other ranks' helpers wait for this or the marker)."""
    backend.put_atomic(fail_key(branch, step), json.dumps({"run": run, "seq": seq, "error": error[:4000]}).encode())


def read_record(backend: Backend, branch: str, step: int, rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s record of ``step``, validated; None if absent."""
    key = record_key(branch, step, rank)
    data = backend.get(key, max_bytes=RECORD_MAX_BYTES)
    if data is None:
        return None
    try:
        doc: Any = json.loads(data)
    except ValueError as e:
        raise CorruptStoreError(f"{key}: not JSON ({e})") from None
    ok = (isinstance(doc, dict) and doc.get("format") == RECORD_FORMAT and doc.get("step") == step
          and doc.get("rank") == rank and doc.get("branch") == branch and isinstance(doc.get("seq"), int)
          and isinstance(doc.get("world"), int) and rank < doc["world"] <= MAX_WORLD
          and isinstance(doc.get("run"), str)
          and isinstance(doc.get("results"), list) and (doc.get("error") is None or isinstance(doc["error"], str)))
    if not ok:
        raise CorruptStoreError(f"{key}: not a rank record of step {step}, rank {rank}")
    out: dict[str, Any] = doc
    return out


def payload(doc: dict[str, Any], where: str) -> tuple[list[ChunkResult] | None, str | None]:
    """A record as the (results, error) pair Writer.commit gathers."""
    if doc["error"] is not None:
        return None, str(doc["error"])[:2000]
    return [decode_result(row, where) for row in doc["results"]], None


def remove_records(backend: Backend, branch: str, step: int, world: int) -> None:
    """Once the step is committed (its marker durable), its records are not needed."""
    for rank in range(world):
        backend.delete(record_key(branch, step, rank))
    backend.delete(fail_key(branch, step))


def commit_doc(backend: Backend, branch: str, step: int) -> dict[str, Any] | None:
    key = f"{L.step_dir(branch, step)}/{L.COMMIT_FILE}"
    data = backend.get(key, max_bytes=L.MAX_DOC_BYTES)
    if data is None:
        return None
    doc: dict[str, Any] = parse_commit(data, key)
    return doc


def read_fail(backend: Backend, branch: str, step: int) -> dict[str, Any] | None:
    """Rank 0's note that ``step`` will not be committed (:func:`write_fail`),
    or None if absent; a note that is no JSON object reads as an empty one."""
    data = backend.get(fail_key(branch, step), max_bytes=FAIL_MAX_BYTES)
    if data is None:
        return None
    try:
        note = json.loads(data)
    except ValueError:
        return {}
    return note if isinstance(note, dict) else {}


def recorded_steps(backend: Backend, branch: str, after: int | None) -> list[int]:
    """Uncommitted steps after ``after`` with rank 0's record, ascending."""
    prefix = L.steps_prefix(branch).rstrip("/")
    out = []
    for d in backend.list_dir(prefix):
        if not (d.isdigit() and len(d) == L.STEP_DIGITS):
            continue
        step = int(d)
        if (after is None or step > after) and not backend.exists(f"{prefix}/{d}/{L.COMMIT_FILE}") \
                and backend.exists(record_key(branch, step, 0)):
            out.append(step)
    return sorted(out)
