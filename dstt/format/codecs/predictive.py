"""Predictive chunks: one chunk coded against its prediction (numpy and
numcodecs only, no torch).

A *chunk* here is a flat slice ``[a, b)`` of one tensor at step t, and its
*inputs* are the same slice of the tensors its predictor reads at step t-1
and t (:func:`plan`; dstt/format/codecs/predictors.py has the predictors). Nothing
needs a whole tensor, so a chunked or sharded store codes and decodes chunk
by chunk.

* :func:`encode` -- ``Z = zigzag(bits(actual) - bits(predicted))`` (unsigned
  integers of the item size, subtraction wrapping: NaN payloads, -0.0, Inf
  and subnormals all round-trip), in the Blosc container delta chunks use
  (byte-shuffle + zstd-1, dstt/format/codecs/delta.py). Work is done in blocks of
  :data:`~dstt.format.codecs.predictors.BLOCK` elements with reused buffers, so a
  block's inputs, prediction and residual stay in cache.
* :func:`decode` -- recomputes the same prediction and adds the residual.
* :func:`plan` and :func:`closure` -- which inputs a chunk's decode needs,
  and everything to decode, in order, to get a chunk at some step of a chain
  from its keyframes: within a step ``exp_avg`` (a chained delta) comes
  before ``exp_avg_sq`` (reads step t's ``exp_avg``) before ``param`` (reads
  step t's ``exp_avg`` and ``exp_avg_sq``).

Inputs are checked against what the coding says (present, the right size);
a missing one or an unknown predictor is refused with a dstt error
(:class:`~dstt.errors.CorruptStoreError`,
:class:`~dstt.errors.FormatVersionError`), never decoded wrong.

>>> import numpy as np
>>> from dstt.format.codecs.predictors import Coding
>>> prev = np.array([1.0, -0.0, np.nan], np.float32)
>>> cur = np.array([1.0, 0.0, np.inf], np.float32)
>>> c = Coding("delta", 1, "other", "float32")
>>> enc = encode(c, cur, {("prev", "other"): prev})
>>> enc.exact, decode(c, enc.blob, 3, {("prev", "other"): prev}).view(np.float32).tolist()
(1, [1.0, 0.0, inf])
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping

import numpy as np

from dstt.errors import CorruptStoreError
from dstt.format.codecs.delta import blosc_decode, blosc_encode
from dstt.format.codecs.predictors import BLOCK, Coding, Need, Predictor, Scratch, check_ieee, predictor
from dstt.format.dtypes import info_for_name

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_KEEP_BYTES = 16 << 20  # residual buffers up to this size are reused per thread
_local = threading.local()


def _scratch() -> Scratch:
    s: Scratch | None = getattr(_local, "scratch", None)
    if s is None:
        s = _local.scratch = Scratch(BLOCK)
    return s


def itemsize(coding: Coding) -> int:
    return info_for_name(coding.dtype).itemsize


def _checked(coding: Coding, where: str) -> Predictor:
    """The coding's predictor, after validating the coding once per object
    (a coding built by hand gets the checks one read from a store gets)."""
    pred = predictor(coding.predictor, coding.version)
    if not coding.__dict__.get("_checked"):
        pred.check(coding, where)
        object.__setattr__(coding, "_checked", True)
    return pred


def plan(coding: Coding) -> list[Need]:
    """The inputs a chunk coded with ``coding`` needs to decode: the same
    slice of each ``Need.role`` tensor at ``Need.when`` (``"prev"``: the
    previous captured step, ``"cur"``: this step)."""
    return coding.needs()


def _uint(buf: Any, size: int, n: int, what: str) -> np.ndarray:
    a = np.frombuffer(memoryview(buf).cast("B"), dtype=_UINT[size])
    if a.shape != (n,):
        raise CorruptStoreError(f"{what} has {a.nbytes} bytes, expected {n * size}")
    return a


def _inputs(coding: Coding, inputs: Mapping[tuple[str, str], Any], n: int, where: str) -> dict[tuple[str, str], np.ndarray]:
    out = {}
    for need in plan(coding):
        key = (need.when, need.role)
        if key not in inputs or inputs[key] is None:
            raise CorruptStoreError(f"{where}: missing companion {need.role} at step "
                                    f"{'t-1' if need.when == 'prev' else 't'} ({coding.predictor} {coding.role})")
        out[key] = _uint(inputs[key], info_for_name(need.dtype).itemsize, n,
                         f"{where}: companion {need.role} ({need.when})")
    return out


def _zigzag(d: np.ndarray, tmp: np.ndarray) -> None:
    """In place: ``d`` (unsigned, wrapping difference) -> zigzag(d)."""
    s, t = d.view(d.dtype.str.replace("u", "i")), tmp.view(d.dtype.str.replace("u", "i"))
    np.right_shift(s, 8 * d.dtype.itemsize - 1, out=t)  # arithmetic: all ones where negative
    np.left_shift(s, 1, out=s)
    np.bitwise_xor(s, t, out=s)


def _unzigzag(z: np.ndarray, tmp: np.ndarray) -> None:
    """In place: ``z`` -> the wrapping difference it encodes."""
    np.bitwise_and(z, 1, out=tmp)
    np.negative(tmp, out=tmp)  # 0 or all ones
    np.right_shift(z, 1, out=z)
    np.bitwise_xor(z, tmp, out=z)


@dataclass(frozen=True)
class Encoded:
    """A coded chunk: the Blosc container, and how many elements were predicted exactly."""

    blob: bytes
    exact: int
    n: int


def _residual_buffer(nbytes: int) -> np.ndarray:
    """A per-thread buffer of at least ``nbytes`` reused across encodes
    (a fresh one would cost its page faults every chunk)."""
    if nbytes > _KEEP_BYTES:  # a rare huge chunk: not kept for the thread's lifetime
        return np.empty(nbytes, np.uint8)
    buf: np.ndarray | None = getattr(_local, "residual", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _local.residual = np.empty(max(nbytes, 1 << 16), np.uint8)
    return buf


def residual(coding: Coding, actual: Any, inputs: Mapping[tuple[str, str], Any], where: str = "chunk",
             out: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """``zigzag(bits(actual) - bits(predicted))`` of a chunk (in ``out``, a
    byte buffer large enough, if given) and its count of zeros."""
    check_ieee()
    pred = _checked(coding, where)
    size = itemsize(coding)
    data = memoryview(actual).cast("B")
    if len(data) % size:
        raise ValueError(f"{where}: {len(data)} bytes is not a whole number of {coding.dtype} elements")
    raw = np.frombuffer(data, dtype=_UINT[size])
    n = len(raw)
    ins = _inputs(coding, inputs, n, where)
    z = np.empty(n, _UINT[size]) if out is None else out[: n * size].view(_UINT[size])
    s = _scratch()
    guess = np.empty(min(n, BLOCK), _UINT[size])
    tmp = np.empty(min(n, BLOCK), _UINT[size])
    exact = 0
    for a in range(0, n, BLOCK):
        b = min(n, a + BLOCK)
        g, t, zb = guess[: b - a], tmp[: b - a], z[a:b]
        pred.predict(coding, {k: v[a:b] for k, v in ins.items()}, g, s)
        np.subtract(raw[a:b], g, out=zb)
        exact += (b - a) - int(np.count_nonzero(zb))
        _zigzag(zb, t)
    return z, exact


def encode(coding: Coding, actual: Any, inputs: Mapping[tuple[str, str], Any], where: str = "chunk", *,
           noise: bool = False) -> Encoded:
    """Code the chunk ``actual`` (raw bytes) against its prediction from
    ``inputs`` (``(when, role)`` -> the same slice's raw bytes); ``noise``:
    in the bit-shuffle + lz4 container (delta.NOISE_CNAME)."""
    nbytes = len(memoryview(actual).cast("B"))
    z, exact = residual(coding, actual, inputs, where, out=_residual_buffer(nbytes))
    return Encoded(blosc_encode(z, z.dtype.itemsize, noise=noise), exact, len(z))


def decode(coding: Coding, blob: Any, n: int, inputs: Mapping[tuple[str, str], Any], where: str = "chunk") -> np.ndarray:
    """The raw bits (unsigned integers) of a chunk of ``n`` elements coded
    with :func:`encode`, from the same inputs."""
    _checked(coding, where)  # an unknown predictor is refused before anything is decoded
    return undo(coding, blosc_decode(blob, n * itemsize(coding), where), n, inputs, where)


def undo(coding: Coding, residual_bytes: Any, n: int, inputs: Mapping[tuple[str, str], Any],
         where: str = "chunk") -> np.ndarray:
    """:func:`decode` of a residual already out of its container: the raw
    bytes of ``zigzag(bits - predicted)`` (a writable buffer of ``n``
    elements, turned into the chunk's raw bits in place)."""
    check_ieee()
    pred = _checked(coding, where)
    size = itemsize(coding)
    ins = _inputs(coding, inputs, n, where)
    z = _uint(residual_bytes, size, n, f"{where}: residual")
    s = _scratch()
    guess = np.empty(min(n, BLOCK), _UINT[size])
    tmp = np.empty(min(n, BLOCK), _UINT[size])
    for a in range(0, n, BLOCK):
        b = min(n, a + BLOCK)
        g, t, zb = guess[: b - a], tmp[: b - a], z[a:b]
        pred.predict(coding, {k: v[a:b] for k, v in ins.items()}, g, s)
        _unzigzag(zb, t)
        np.add(zb, g, out=zb)
    return z


def pick(candidates: list[Coding], actual: Any, inputs: Mapping[tuple[str, str], Any], sample: int = 4096) -> Coding:
    """The candidate that predicts the most of the chunk's first ``sample``
    elements exactly (the first on a tie). For hyperparameters a capture
    cannot pin to one step: an lr scheduler steps between ``optimizer.step()``
    and the capture or after it, so the lr that made step t is in step t's
    ``param_groups`` or in step t-1's. Which one wins costs bytes only: the
    chosen coding is recorded with the chunk."""
    if len(candidates) == 1:
        return candidates[0]
    size = itemsize(candidates[0])
    head = memoryview(actual).cast("B")[: sample * size]
    n = len(head) // size
    best, best_exact = candidates[0], -1
    for i, c in enumerate(candidates):
        if c in candidates[:i]:  # equal codings once
            continue
        part = {k: memoryview(v).cast("B")[: n * info_for_name(nd.dtype).itemsize]
                for nd in plan(c) for k, v in [((nd.when, nd.role), inputs.get((nd.when, nd.role)))] if v is not None}
        _, exact = residual(c, head, part)
        if exact > best_exact:
            best, best_exact = c, exact
    return best


# ----------------------------------------------------------------------------- chains


Item = tuple[Hashable, str]  # (step, role)


def closure(step: Hashable, role: str, coding_at: Callable[[Hashable, str], Coding | None],
            prev_of: Callable[[Hashable], Hashable | None]) -> list[Item]:
    """Every ``(step, role)`` chunk to decode, in an order that decodes each
    after its inputs, to get ``role`` at ``step``: ``coding_at(step, role)``
    is the chunk's coding (None: stored whole, a keyframe) and ``prev_of``
    the previous captured step. A reader decodes this list once with a
    cache, so neighbouring steps share their work.

    >>> from dstt.format.codecs.predictors import Coding
    >>> d = Coding("delta", 1, "exp_avg", "float32")
    >>> v = Coding("adam", 1, "exp_avg_sq", "float32", {"grad": "float32", "round": "op", "fresh": False,
    ...            "c": {"W": 0.1, "B2": 0.999, "C2": 0.001}})
    >>> codings = {(0, "exp_avg"): None, (0, "exp_avg_sq"): None, (1, "exp_avg"): d, (1, "exp_avg_sq"): v}
    >>> closure(1, "exp_avg_sq", lambda s, r: codings[s, r], lambda s: s - 1 if s else None)
    [(0, 'exp_avg'), (0, 'exp_avg_sq'), (1, 'exp_avg'), (1, 'exp_avg_sq')]
    """
    order: list[Item] = []
    done: set[Item] = set()
    active: set[Item] = set()
    stack: list[tuple[Item, bool]] = [((step, role), False)]
    while stack:  # iterative depth-first: a chain of any length, no recursion limit
        item, expanded = stack.pop()
        if item in done:
            continue
        if expanded:
            active.discard(item)
            done.add(item)
            order.append(item)
            continue
        if item in active:
            raise CorruptStoreError(f"{item}: its coding depends on itself")
        coding = coding_at(*item)
        active.add(item)
        stack.append((item, True))
        if coding is None:
            continue
        if coding.role != item[1]:
            raise CorruptStoreError(f"{item}: coded as role {coding.role!r}")
        prev = prev_of(item[0])
        for need in reversed(plan(coding)):
            if need.when == "prev" and prev is None:
                raise CorruptStoreError(f"{need.role} at step {item[0]!r} is coded against a previous step, "
                                        "but there is none")
            dep = (prev if need.when == "prev" else item[0], need.role)
            if dep not in done:
                stack.append((dep, False))
    return order


__all__ = ["Encoded", "closure", "decode", "encode", "itemsize", "pick", "plan", "residual", "undo"]
