"""The writer's half of predictive chunks: which tensors of a step code
together, and the coding of each chunk against the previous step
(torch-free; docs/format.md "Predictive chunks").

* :func:`groups_of` reads a step's value tree: each optimizer parameter
  (``optim/param_groups`` names them) becomes a :class:`Group` of its
  parameter tensor and the optimizer state tensors with the same shape and
  chunking (a chunk of each covers the same elements), in decode order
  (``exp_avg`` before ``exp_avg_sq`` before ``param``), with its
  hyperparameters and its ``step`` counter; every other tensor is a group
  of its own (a chained delta, role ``other``).
* :class:`StepCoder` codes one step's chunks group by group against what it
  remembers of the previous coded step (:class:`Prev`: the raw bytes of
  each chunk, how many steps its decode replays, the stored size of its
  last keyframe). All roles of a group's chunk are keyframes at the same
  steps: a chunk is stored whole when its decode would replay K or more
  steps (``keyframe_every``), when the previous step is not the one its
  group's other chunks remember, or when the coded residual is not below
  :data:`~dstt.format.codecs.keyframes.DELTA_MAX_RATIO` of its keyframe's
  stored size. Hyperparameters of step t and of t-1 are both tried (an lr
  scheduler steps before or after the capture): the one that predicts the
  chunk's first elements better is recorded.

The coder never decides whether a chunk decodes right: the decoder
recomputes the recorded coding; a wrong guess costs bytes.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from dstt.errors import DsttError
from dstt.format.codecs import predictive
from dstt.format.codecs.delta import DELTA_ITEMSIZES
from dstt.format.codecs.keyframes import DELTA_MAX_RATIO, Decision
from dstt.format.codecs.optimspec import ParamState, param_codings
from dstt.format.codecs.predictors import FLOAT_DTYPES, Coding
from dstt.format.codecs.spec import CodecSpec, encode_chunk
from dstt.format.dtypes import info_for_name
from dstt.format.predindex import ChunkPred

#: Decode order of the roles of one parameter (``other``: a tensor of its own).
ROLE_ORDER = ("other", "exp_avg", "momentum_buffer", "exp_avg_sq", "max_exp_avg_sq", "param")
#: Roles that are fresh gradient noise (a chained delta of them is ~0.8 of
#: raw whatever codes it): their residuals go in the cheaper noise container
#: (delta.NOISE_CNAME), as every keyframe does (a tensor's raw values are
#: mostly mantissa noise too: ~0.8-0.88 of raw with either container, lz4
#: ~2.4x zstd-1's bytes per CPU second); the other residuals, mostly zeros,
#: keep zstd (0.05 of raw instead of 0.06-0.09).
NOISE_ROLES = ("exp_avg", "momentum_buffer")
#: A noise role's chunk whose residual did not pay (not below
#: DELTA_MAX_RATIO of its keyframe: ~0.83 vs ~0.81 of raw for AdamW's
#: exp_avg at beta1 0.9, benchmarks/bench_encode.py) is stored whole without
#: trying for this many coded steps, then tried again (a slower beta1, a
#: later phase of training, can make it pay).
NOISE_RETRY_STEPS = 8


@dataclass(frozen=True)
class Member:
    """One tensor of a group: its role, name, dtype, shape and chunking."""

    role: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]


@dataclass(frozen=True)
class Group:
    """Tensors whose chunks code together (see the module doc)."""

    key: str
    members: tuple[Member, ...]  # decode order
    optimizer: str | None = None  # "Adam", "AdamW", "SGD" or None (chained deltas)
    hyper: Mapping[str, Any] | None = None
    counter: str | None = None  # the 0-d ``step`` tensor of the parameter's state

    @property
    def inputs(self) -> dict[str, str]:
        return {m.role: m.name for m in self.members}


def _untag(v: Any) -> Any:
    """A hyperparameter from the value tree as a plain value (None: unknown)."""
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, list):
        return [_untag(x) for x in v]
    if isinstance(v, dict) and len(v) == 1:
        (tag, arg), = v.items()
        if tag == "$tuple" and isinstance(arg, list):
            return tuple(_untag(x) for x in arg)
        if tag == "$float" and arg in ("nan", "inf", "-inf"):
            return float(arg)
        if tag == "$np" and isinstance(arg, list) and len(arg) == 2 and isinstance(arg[1], (int, float)):
            return float(arg[1])
    return None


def optimizer_kind(hyper: Mapping[str, Any]) -> str | None:
    """The torch.optim class a ``param_groups`` entry belongs to, from its
    keys (a wrong guess costs bytes, never correctness): Adam/AdamW have
    ``amsgrad``, SGD ``nesterov`` and ``dampening``."""
    if "amsgrad" in hyper and "betas" in hyper:
        return "AdamW" if hyper.get("decoupled_weight_decay") else "Adam"
    if "nesterov" in hyper and "dampening" in hyper and "momentum" in hyper:
        return "SGD"
    return None


def _tensor(tree: Any, *path: str) -> str | None:
    node = tree
    for k in path:
        if not isinstance(node, dict):
            return None
        node = node.get(k)
    if isinstance(node, dict) and len(node) == 1 and isinstance(node.get("$tensor"), str):
        return str(node["$tensor"])
    return None


Layouts = Mapping[str, tuple[str, tuple[int, ...], tuple[int, ...]]]  # name -> (dtype, shape, chunk shape)


def codable(dtype: str, itemsize: int) -> bool:
    return itemsize in DELTA_ITEMSIZES and not dtype.startswith("complex")


def groups_of(tree: Any, layouts: Layouts) -> list[Group]:
    """The groups of a step (see the module doc) from its value tree and its
    tensors (``layouts``); tensors of item sizes that cannot be coded
    (complex128) are in no group."""
    groups: list[Group] = []
    taken: set[str] = set()
    optim = tree.get("optim") if isinstance(tree, dict) else None
    if not isinstance(optim, dict):
        optim = {}
    pgs = optim.get("param_groups")
    for pg in pgs if isinstance(pgs, list) else []:
        if not isinstance(pg, dict) or not isinstance(pg.get("params"), list):
            continue
        hyper = {k: _untag(v) for k, v in pg.items() if k != "params"}
        kind = optimizer_kind(hyper)
        for pname in pg["params"]:
            if not isinstance(pname, str) or not isinstance(optim.get(pname), dict):
                continue
            pt = _tensor(tree, "model", pname)
            if pt is None or pt not in layouts or pt in taken:
                continue
            _, shape, chunk = layouts[pt]
            members = [("param", pt)]
            for key in optim[pname]:
                name = _tensor(optim, pname, key)
                if name is not None and key != "step" and name in layouts and name not in taken \
                        and layouts[name][1:] == (shape, chunk) and key in ROLE_ORDER[1:-1]:
                    members.append((key, name))
            ms = tuple(Member(r, n, layouts[n][0], shape, chunk) for r, n in
                       sorted(members, key=lambda m: ROLE_ORDER.index(m[0]))
                       if codable(layouts[n][0], info_for_name(layouts[n][0]).itemsize))
            if not ms:
                continue
            taken.update(m.name for m in ms)
            counter = _tensor(optim, pname, "step")
            groups.append(Group(pname, ms, kind, hyper, counter if counter in layouts else None))
    for name, (dtype, shape, chunk) in layouts.items():
        if name not in taken and codable(dtype, info_for_name(dtype).itemsize):
            groups.append(Group(name, (Member("other", name, dtype, shape, chunk),)))
    return groups


@dataclass
class Prev:
    """What the coder remembers of one chunk of the previous coded step."""

    step: int
    raw: np.ndarray  # its raw bytes (uint8)
    depth: int  # steps its decode replays (0: stored whole)
    key_size: int  # stored bytes of its last keyframe
    #: ``raw`` is a view of memory the caller holds (the capture helper's
    #: ring slot of that step), not a copy: :meth:`StepCoder.detach` copies
    #: it before that memory is given back.
    borrowed: bool = False
    #: Coded steps its residual is not tried for (a noise role whose last
    #: residual was not below DELTA_MAX_RATIO of its keyframe).
    skip: int = 0


@dataclass
class StepCoder:
    """Codes chunks against the previous coded step (see the module doc).

    One per writer; steps are coded in plan order (:meth:`code_group` calls
    of step t after those of t-1: the caller serializes steps), groups of
    one step in parallel."""

    keyframe_every: int
    codec: CodecSpec
    memory: dict[tuple[str, int], Prev] = field(default_factory=dict)
    states: dict[str, tuple[ParamState, Mapping[str, Any] | None]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Bytes of remembered chunks at most (None: no bound): a chunk that
    #: would exceed it is not remembered, so its next step stores it whole.
    memory_limit: int | None = None
    held: int = 0
    #: The chunks' raw bytes stay valid until the caller calls
    #: :meth:`detach` for their step (the capture helper's memory tier: a
    #: step's ring slot is given back only after that), so they are
    #: remembered as views, not copied; borrowed bytes do not count
    #: against :attr:`memory_limit`.
    borrow: bool = False
    #: The step coded (or remembered) last (store/predflush.py sets it).
    last_step: int | None = None
    _codings_cache: dict[Any, tuple[Mapping[str, Any], dict[str, Coding | None]]] = field(default_factory=dict)

    def remember(self, key: tuple[str, int], prev: Prev) -> None:
        """Keep ``prev`` for ``key`` within :attr:`memory_limit` (caller holds the lock)."""
        old = self.memory.pop(key, None)
        if old is not None and not old.borrowed:
            self.held -= old.raw.nbytes
        if prev.borrowed:
            self.memory[key] = prev
            return
        if self.memory_limit is not None and self.held + prev.raw.nbytes > self.memory_limit:
            return
        self.memory[key] = prev
        self.held += prev.raw.nbytes

    def _raw(self, buf: Any) -> np.ndarray:
        """A chunk's raw bytes as remembered: a view when :attr:`borrow`, else a copy."""
        a = np.frombuffer(memoryview(buf).cast("B"), np.uint8)
        return a if self.borrow else a.copy()

    def detach(self, step: int) -> int:
        """The memory behind ``step``'s borrowed chunks is about to be given
        back: copy what is remembered of them (within
        :attr:`memory_limit`; beyond it a chunk is forgotten, so its next
        step stores it whole). The bytes copied."""
        copied = 0
        with self.lock:
            for key, p in list(self.memory.items()):
                if p.step == step and p.borrowed:
                    self.remember(key, Prev(p.step, p.raw.copy(), p.depth, p.key_size, skip=p.skip))
                    if key in self.memory:
                        copied += p.raw.nbytes
                    else:  # (over the bound: the borrowed view must not stay)
                        self.memory.pop(key, None)
        return copied

    def forget(self) -> None:
        """Drop everything remembered: the next step is all keyframes."""
        with self.lock:
            self.memory.clear()
            self.states.clear()
            self.held = 0
            self.last_step = None

    def forget_group(self, g: Group) -> None:
        """Drop what is remembered of ``g``'s chunks (not coded this step)."""
        names = {m.name for m in g.members}
        with self.lock:
            for k in [k for k in self.memory if k[0] in names]:
                p = self.memory.pop(k)
                if not p.borrowed:
                    self.held -= p.raw.nbytes
            self.states.pop(g.key, None)

    def codings(self, g: Group, step_value: float | None) -> dict[str, list[Coding]]:
        """The candidate codings of each role of group ``g`` at this step
        (both hyperparameter sets when they changed), remembering this
        step's parameter state for the next."""
        dtypes = {m.role: m.dtype for m in g.members}
        cur = ParamState(dtypes.get("param", ""), {r: d for r, d in dtypes.items() if r != "param"}, step_value)
        with self.lock:
            before = self.states.get(g.key)
            self.states[g.key] = (cur, g.hyper)
        out: dict[str, list[Coding]] = {}
        if g.optimizer is None or g.hyper is None or "param" not in dtypes or before is None:
            for m in g.members:
                out[m.role] = [Coding("delta", 1, m.role, m.dtype)]
            return out
        prev_state, prev_hyper = before
        tries = [g.hyper] + ([prev_hyper] if prev_hyper is not None and prev_hyper != g.hyper else [])
        for hyper in tries:
            got = self._param_codings(g.optimizer, hyper, cur, prev_state)
            for role, c in got.items():
                if c is not None and c not in out.setdefault(role, []):
                    out[role].append(c)
        for m in g.members:
            if not out.get(m.role):
                out[m.role] = [Coding("delta", 1, m.role, m.dtype)]
        return out

    def _param_codings(self, optimizer: str, hyper: Mapping[str, Any], cur: ParamState,
                       prev: ParamState) -> dict[str, Coding | None]:
        """:func:`param_codings` ({} where it cannot read the hyperparameters:
        deltas), computed once per distinct input: the parameters of a
        ``param_groups`` entry share their codings within a step, so each
        coding is built, and checked by the coder, once rather than once per
        parameter. Keyed by the hyperparameters' identity (each step reads
        new ones; the cache keeps them alive, so an identity is never reused
        while cached)."""
        key = (optimizer, id(hyper), _state_key(cur), _state_key(prev))
        with self.lock:
            hit = self._codings_cache.get(key)
        if hit is not None:
            return hit[1]
        try:
            got = param_codings(optimizer, hyper, cur, prev)
        except (DsttError, KeyError, TypeError, ValueError):  # hyperparameters it cannot read: deltas
            got = {}
        with self.lock:
            if len(self._codings_cache) >= 256:
                self._codings_cache.clear()
            self._codings_cache[key] = (hyper, got)
        return got

    def code_group(self, g: Group, i: int, step: int, raws: Mapping[str, Any],
                   codings: Mapping[str, list[Coding]], *, remember_only: bool = False) -> dict[str, Decision]:
        """The decision for chunk ``i`` of every member of ``g`` at ``step``
        (``raws[role]``: its raw bytes), and the memory updated for the next
        step. ``remember_only``: the step is stored fast (uncompressed, whole,
        by the caller): only remembered, as keyframes, no decisions."""
        keys = {m.role: (m.name, i) for m in g.members}
        with self.lock:
            prevs = {r: self.memory.get(k) for r, k in keys.items()}
        sizes = {r: len(memoryview(raws[r]).cast("B")) for r in keys}
        usable = all(p is not None and p.raw.nbytes == sizes[r] for r, p in prevs.items())
        steps = {p.step for p in prevs.values() if p is not None}
        depth = 1 + max((p.depth for p in prevs.values() if p is not None), default=0)
        coded_ok = usable and len(steps) == 1 and depth < self.keyframe_every and next(iter(steps)) < step
        out: dict[str, Decision] = {}
        if remember_only:
            with self.lock:
                for m in g.members:
                    raw = self._raw(raws[m.role])
                    self.remember(keys[m.role], Prev(step, raw, 0, raw.nbytes, self.borrow))
            return out
        skips: dict[str, int] = {}
        for m in g.members:
            raw = raws[m.role]
            itemsize = sizes[m.role] // max(1, math.prod(m.chunk_shape))
            prev = prevs[m.role]
            d = None
            skips[m.role] = 0
            if coded_ok and prev is not None and m.role in NOISE_ROLES and prev.skip > 0:
                skips[m.role] = prev.skip - 1  # (its residual did not pay lately: stored whole, not tried)
            elif coded_ok and prev is not None:
                d = self._predict(m, raw, prevs, raws, codings.get(m.role, []), step, itemsize, prev)
                if d is None and m.role in NOISE_ROLES:
                    skips[m.role] = NOISE_RETRY_STEPS
            if d is None:
                d = Decision(encode_chunk(memoryview(raw).cast("B"), self.codec, itemsize=itemsize, noise=True))
            out[m.role] = d
        with self.lock:
            for m in g.members:
                d, prev = out[m.role], prevs[m.role]
                whole = d.coding is None
                d.raw = self._raw(raws[m.role])
                self.remember(keys[m.role], Prev(step, d.raw, 0 if whole else depth,
                                                 d.size if whole or prev is None else prev.key_size, self.borrow,
                                                 skips[m.role]))
        return out

    def _predict(self, m: Member, raw: Any, prevs: Mapping[str, Prev | None], raws: Mapping[str, Any],
                 cands: list[Coding], step: int, itemsize: int, prev: Prev) -> Decision | None:
        """The predictive decision for one chunk, or None (store it whole)."""
        if not cands or (m.dtype not in FLOAT_DTYPES and cands[0].predictor != "delta"):
            return None
        plan = predictive.plan(cands[0])
        cands = [c for c in cands if predictive.plan(c) == plan]
        ins: dict[tuple[str, str], Any] = {}
        for need in plan:
            src = prevs.get(need.role) if need.when == "prev" else None
            if need.when == "prev":
                if src is None:
                    return None
                ins[need.when, need.role] = src.raw
            elif need.role in raws:
                ins[need.when, need.role] = raws[need.role]
            else:
                return None
        coding = predictive.pick(cands, raw, ins)
        z, exact = predictive.residual(coding, raw, ins, m.name)
        parts = encode_chunk(z.data.cast("B"), self.codec, itemsize=itemsize, noise=m.role in NOISE_ROLES)
        d = Decision(parts, coding, ChunkPred(0, step, prev.step), exact)
        return d if d.size < DELTA_MAX_RATIO * prev.key_size else None


def _state_key(p: ParamState) -> tuple[Any, ...]:
    return p.dtype, tuple(sorted(p.state.items())), p.step


def counter_value(raw: Any, dtype: str) -> float | None:
    """The value of a 0-d ``step`` counter from its raw bytes."""
    if dtype not in ("float32", "float64", "int64", "int32"):
        return None
    a = np.frombuffer(memoryview(raw).cast("B"), dtype=np.dtype(dtype).newbyteorder("<"))
    return float(a[0]) if a.size == 1 else None


__all__ = ["Decision", "Group", "Member", "NOISE_ROLES", "Prev", "ROLE_ORDER", "StepCoder", "counter_value", "groups_of",
           "optimizer_kind"]
