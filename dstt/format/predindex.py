"""The ``pred`` record of a predictively coded tensor's index entry
(format version 5; docs/format.md "Predictive chunks"), torch-free.

An entry with predictive chunks has one more key::

    "pred": {"array": "<array>.delta",
             "inputs": {"param": "model/w", "exp_avg": "optim/w/exp_avg", "exp_avg_sq": "optim/w/exp_avg_sq"},
             "codings": [{"predictor": "adam", "version": 1, "role": "param", ...}],
             "chunks": [null, [0, 12, 11]]}

* ``inputs`` maps every role a coding of the entry reads to the tensor that
  holds it (the entry's own role to its own name);
* ``codings`` the distinct codings its chunks use (predictors.Coding JSON);
* ``chunks[i]`` is ``null`` when chunk ``i`` is stored whole (at
  ``slots[i]`` of ``array``, or its pack range: a *keyframe*), else
  ``[k, cur, prev]``: chunk ``i`` holds ``zigzag(bits - predicted)``
  (at ``slots[i]`` of ``pred.array``, or its pack range), predicted with
  ``codings[k]`` from the inputs' chunk ``i`` at step ``cur`` (the step
  that coded it: this one, or an earlier one for an unchanged chunk this
  step references) and at step ``prev`` (the step before ``cur`` it was
  predicted from), both steps of this step's branch or its ancestry.

>>> doc = {"array": "tensors/w/@f.delta", "inputs": {"other": "w"},
...        "codings": [{"predictor": "delta", "version": 1, "role": "other", "dtype": "float32", "params": {}}],
...        "chunks": [None, [0, 5, 4]]}
>>> p = parse_pred(doc, "x", name="w", array="tensors/w/@f", dtype="float32", nchunks=2, itemsize=4, step=5)
>>> p.chunks[1], p.coding(1).predictor, p.to_json() == doc
(ChunkPred(coding=0, cur=5, prev=4), 'delta', True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from dstt.errors import CorruptStoreError
from dstt.format.codecs.delta import DELTA_ITEMSIZES
from dstt.format.codecs.predictors import ROLES, Coding
from dstt.format.layout import DELTA_SUFFIX, MAX_STEP

#: The most distinct codings one entry records (a tensor's chunks share a few).
MAX_CODINGS = 64


class ChunkPred(NamedTuple):
    """How one predictive chunk was coded: ``codings[coding]``, inputs at
    steps ``cur`` and ``prev``."""

    coding: int
    cur: int
    prev: int


@dataclass
class PredInfo:
    """The ``pred`` record of one index entry."""

    array: str
    inputs: dict[str, str]
    codings: list[Coding]
    chunks: list[ChunkPred | None]

    def coding(self, i: int) -> Coding | None:
        """The coding of chunk ``i``; None if it is stored whole."""
        c = self.chunks[i]
        return None if c is None else self.codings[c.coding]

    def coded(self) -> bool:
        """Whether any chunk is predictively coded."""
        return any(c is not None for c in self.chunks)

    def to_json(self) -> dict[str, Any]:
        return {"array": self.array, "inputs": dict(self.inputs), "codings": [c.to_json() for c in self.codings],
                "chunks": [None if c is None else list(c) for c in self.chunks]}


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise CorruptStoreError(f"{where}: {what}")


def _step(v: Any, where: str, what: str) -> int:
    _need(type(v) is int and 0 <= v <= MAX_STEP, where, f"{what} must be a step number, got {v!r:.50}")
    return int(v)


def parse_pred(raw: Any, where: str, *, name: str, array: str, dtype: str, nchunks: int, itemsize: int,
               step: int | None, blosc: bool = True) -> PredInfo:
    """A ``pred`` record, validated against its entry (untrusted input):
    the array is the entry's ``.delta`` sibling, every input role names a
    tensor and the entry's own role names the entry, every coding is known
    (FormatVersionError otherwise) and codes this tensor's dtype, chunk
    records are in range with ``prev < cur`` and (``step`` given) ``cur``
    at most this step."""
    _need(isinstance(raw, dict) and set(raw) == {"array", "inputs", "codings", "chunks"}, where,
          "pred must be an object with array, inputs, codings and chunks")
    _need(blosc and itemsize in DELTA_ITEMSIZES, where, f"predictive coding of a {dtype} tensor with this codec")
    _need(raw["array"] == array + DELTA_SUFFIX, where,
          f"pred array must be {array + DELTA_SUFFIX!r}, got {raw['array']!r:.200}")
    inputs = raw["inputs"]
    _need(isinstance(inputs, dict) and 0 < len(inputs) <= len(ROLES)
          and all(r in ROLES and isinstance(n, str) and 0 < len(n) <= 4096 for r, n in inputs.items()),
          where, "pred inputs must map roles to tensor names")
    codings_raw = raw["codings"]
    _need(isinstance(codings_raw, list) and len(codings_raw) <= MAX_CODINGS, where,
          f"pred codings must be a list of at most {MAX_CODINGS}")
    codings = [Coding.from_json(c, where) for c in codings_raw]
    for c in codings:
        _need(c.dtype == dtype, where, f"a {c.dtype} coding on a {dtype} tensor")
        _need(inputs.get(c.role) == name, where, f"coding role {c.role!r} is not this tensor in pred inputs")
        for nd in c.needs():
            _need(nd.role in inputs, where, f"coding {c.predictor} {c.role} reads {nd.role!r}, not in pred inputs")
    chunks_raw = raw["chunks"]
    _need(isinstance(chunks_raw, list) and len(chunks_raw) == nchunks, where, f"pred chunks must list {nchunks} entries")
    chunks: list[ChunkPred | None] = []
    for c in chunks_raw:
        if c is None:
            chunks.append(None)
            continue
        _need(isinstance(c, list) and len(c) == 3, where, "a pred chunk must be [coding, cur, prev]")
        k = c[0]
        _need(type(k) is int and 0 <= k < len(codings), where, f"pred chunk coding {k!r:.50} out of range")
        cur, prev = _step(c[1], where, "pred cur"), _step(c[2], where, "pred prev")
        _need(prev < cur, where, f"pred chunk predicted from step {prev}, not before step {cur}")
        _need(step is None or cur <= step, where, f"pred chunk coded at step {cur}, after this step {step}")
        chunks.append(ChunkPred(k, cur, prev))
    return PredInfo(raw["array"], dict(inputs), codings, chunks)


__all__ = ["ChunkPred", "MAX_CODINGS", "PredInfo", "parse_pred"]
