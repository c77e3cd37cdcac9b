"""Time travel: load a captured step back into live training objects.

``restore`` is the inverse of :func:`dstt.state_of`: it puts a step's model
weights, optimizer state (matched by parameter *name*, so a freshly built
optimizer works), scheduler state and RNG states back, and returns the step's
``extra`` dict (data position, epoch, ...).

It validates everything before touching anything: missing or unexpected keys,
shape and dtype mismatches are collected into one
:class:`~dstt.errors.RestoreMismatchError`, and the live objects stay as they
were. All tensor data is read before the first live object is modified, so a
read error cannot leave a half-restored model either.

Under torch.distributed each rank reads only the box of each tensor its
DTensor shard covers (FSDP2, tensor parallel), whatever the world size the
step was captured with, and gets DTensors with the live parameter's mesh and
placements back.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Set as AbstractSet
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dstt.errors import RestoreMismatchError, RestoreWarning
from dstt.format import args as A
from dstt.format.chunks import read_whole_into
from dstt.format.index import StepRecord
from dstt.format.refs import StepRef
from dstt.store.reader import TensorReader
from dstt.store.shards import dtensor_regions, is_dtensor
from dstt.store.state import PARAM_GROUPS, _param_names, _rank, check_objects, set_rng_state
from dstt.store.torch_dtypes import torch_dtype, torch_storage
from dstt.store.tree import unflatten

#: How many problems the error message spells out (all are in ``.problems``).
MAX_LISTED = 12


@dataclass(frozen=True)
class Stored:
    """A tensor of the step, not read yet."""

    name: str
    kind: str


@dataclass
class _Load:
    """One tensor to read: which box of it, and how to wrap the result."""

    name: str
    box: tuple[slice, ...] | None  # None: the whole tensor
    wrap: Callable[[torch.Tensor], Any]


#: A stored value that does not fit its live counterpart (strict=False leaves it out).
SKIPPED = object()


@dataclass
class _Plan:
    """Everything a restore will do, decided before anything is read."""

    problems: list[str] = field(default_factory=list)
    loads: dict[tuple[str, ...], _Load] = field(default_factory=dict)  # path -> load
    skipped: set[tuple[str, ...]] = field(default_factory=set)  # paths (or whole subtrees) left out

    def add(self, path: tuple[str, ...], name: str, box: tuple[slice, ...] | None = None,
            wrap: Callable[[torch.Tensor], Any] = lambda t: t) -> None:
        self.loads[path] = _Load(name, box, wrap)


# ----------------------------------------------------------------------------- public API


def restore(
    ref: Any,
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    rng: bool = True,
    strict: bool = True,
    threads: int = 4,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Restore step ``ref`` (``STORE[@BRANCH][:STEP]`` or an open :class:`Run`)
    into live objects; return the step's ``extra`` dict (``{}`` if none).

    ``strict=True`` (default): any mismatch raises one RestoreMismatchError
    listing every problem, and nothing is modified. ``strict=False`` loads
    what matches and warns about the rest.

    >>> import tempfile, torch, dstt
    >>> m = torch.nn.Linear(3, 2); opt = torch.optim.Adam(m.parameters())
    >>> path = tempfile.mkdtemp() + "/run"
    >>> _ = dstt.save(path, 7, dstt.state_of(model=m, optimizer=opt, extra={"pos": 42}))
    >>> m2 = torch.nn.Linear(3, 2); opt2 = torch.optim.Adam(m2.parameters())
    >>> dstt.restore(f"{path}:7", model=m2, optimizer=opt2)
    {'pos': 42}
    >>> torch.equal(m2.weight, m.weight)
    True
    """
    run = ref if isinstance(ref, TensorReader) else TensorReader(os.fspath(ref), storage_options=storage_options)
    rec = run.record()
    return apply_step(rec, store_read(run, rec), f"step {rec.step} of branch {rec.branch!r} in {run.url}", model=model,
                      optimizer=optimizer, scheduler=scheduler, rng=rng, strict=strict, threads=threads)


#: Reads one tensor of a step (a box of it, or whole for None) into a tensor
#: the caller may keep (an optimizer keeps what it is given).
ReadTensor = Callable[[str, "tuple[slice, ...] | None"], torch.Tensor]


def store_read(run: TensorReader, rec: StepRecord) -> ReadTensor:
    """How :func:`apply_step` reads the tensors of a stored step."""
    def read(name: str, box: tuple[slice, ...] | None) -> torch.Tensor:
        return read_whole(run, rec, name) if box is None else run.read(name, rec.step, branch=rec.branch, index=box)

    return read


def apply_step(rec: Any, read: ReadTensor, where: str, *, model: torch.nn.Module | None = None,
               optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None, rng: bool = True,
               strict: bool = True, threads: int = 4, validated: Callable[[], Any] | None = None) -> dict[str, Any]:
    """:func:`restore` from any source of a step: ``rec`` describes it
    (``objects``, the value tree; ``by_name``, each tensor's ``shape`` and
    ``dtype``; ``step``), ``read`` reads its tensors. Used by ``restore``
    (the store) and ``Capture.rewind`` (the memory tier's host ring).
    ``validated`` runs once the step is known to fit the live objects,
    before anything is read or changed (a rewind records its incident
    then: a refused rewind records none)."""
    check_objects(model, optimizer, scheduler, restoring=True)
    A.flag("rng", rng)
    A.flag("strict", strict)
    tree = rec.objects if isinstance(rec.objects, dict) else {}
    plan = _Plan()
    if model is not None:
        _plan_model(plan, rec, tree.get("model"), model)
    if optimizer is not None:
        _plan_optimizer(plan, rec, tree.get("optim"), optimizer, model)
    if scheduler is not None:
        _plan_scheduler(plan, tree.get("scheduler"), scheduler)
    if plan.problems:
        if strict:
            raise mismatch_error(where, plan.problems)
        warnings.warn(f"partial restore of {where}: " + "; ".join(plan.problems[:MAX_LISTED]), RestoreWarning,
                      stacklevel=2)
    if validated is not None:
        validated()
    data = _read_all(read, plan, threads)
    # Every value the live objects will get -- planned tensors, and tensors
    # nested in other values (a module's extra state, a tensor lr, LBFGS's
    # history lists) -- is read now: only then are the live objects touched.
    wanted = {"model": model is not None, "optim": optimizer is not None, "scheduler": scheduler is not None,
              "rng": rng, "extra": True}
    small = _small_reader(read)
    tree = {**tree, "rng": _own_rng(tree["rng"])} if rng and "rng" in tree else tree
    got = {k: _materialize(tree[k], (k,), data, small, plan.skipped)
           for k, want in wanted.items() if want and k in tree and (k,) not in plan.skipped}
    if model is not None and isinstance(got.get("model"), dict):
        _apply_model(model, got["model"], strict)
    if optimizer is not None and isinstance(got.get("optim"), dict):
        _apply_optimizer(optimizer, model, got["optim"])
    if isinstance(got.get("scheduler"), dict):
        scheduler.load_state_dict(got["scheduler"])
    if "rng" in got:
        _apply_rng(got["rng"])
    extra = got.get("extra", {})
    return extra if isinstance(extra, dict) else {"extra": extra}


def branch(ref: Any, name: str) -> StepRef:
    """Create branch ``name`` forking at ``ref`` (``STORE[@BRANCH][:STEP]``,
    latest step by default) without copying data; returns the parent
    :class:`~dstt.StepRef`. Capturing with ``branch=name, parent=that`` then
    continues it.

    >>> import tempfile, torch, dstt
    >>> path = tempfile.mkdtemp() + "/run"
    >>> _ = dstt.save(path, 3, {"w": torch.ones(2)})
    >>> dstt.branch(path, "try-b")
    StepRef(branch='main', step=3)
    >>> dstt.open(path).branch_info("try-b").parent
    StepRef(branch='main', step=3)
    """
    from dstt.format.root import create_branch

    run = ref if isinstance(ref, TensorReader) else TensorReader(os.fspath(ref))
    parent = run.resolve()
    create_branch(run.backend, name, parent)
    return parent


def mismatch_error(where: str, problems: list[str]) -> RestoreMismatchError:
    shown = "; ".join(problems[:MAX_LISTED])
    more = f"; ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    return RestoreMismatchError(
        f"{where} does not match the live objects ({len(problems)} problem"
        f"{'s' if len(problems) != 1 else ''}; nothing was restored): {shown}{more}", problems)


# ----------------------------------------------------------------------------- planning


def _stored_tree(tree: Any) -> Any:
    """The value tree with :class:`Stored` placeholders for tensors."""
    return unflatten(tree, lambda n, k: Stored(n, k))


def _describe(t: Any) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _check_tensor(plan: _Plan, rec: StepRecord, what: str, stored: Any, live: torch.Tensor) -> bool:
    """Shape and dtype of a stored tensor against a live one; record problems."""
    if not isinstance(stored, Stored):
        plan.problems.append(f"{what}: stored value is a {type(stored).__name__}, live one is a tensor")
        return False
    e = rec.by_name.get(stored.name)
    if e is None:
        plan.problems.append(f"{what}: tensor {stored.name!r} missing from the step index")
        return False
    live_dtype = str(live.dtype).removeprefix("torch.")
    if tuple(e.shape) != tuple(live.shape) or e.dtype.logical != live_dtype:
        plan.problems.append(
            f"{what}: stored {tuple(e.shape)} {e.dtype.logical}, live {tuple(live.shape)} {live_dtype}"
        )
        return False
    return True


def _local_box(t: Any) -> tuple[tuple[slice, ...], Callable[[torch.Tensor], Any]]:
    """For a DTensor: the global box this rank holds and how to wrap a local
    block into a DTensor like ``t`` (same mesh, placements, global shape)."""
    from torch.distributed.tensor import DTensor

    _regions, offset, local = dtensor_regions(t)
    box = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
    mesh, placements, shape, stride = t.device_mesh, t.placements, t.shape, t.stride()

    def wrap(block: torch.Tensor) -> Any:
        block = block.to(local.device)
        return DTensor.from_local(block, mesh, placements, run_check=False, shape=shape, stride=stride)

    return box, wrap


def _plan_tensor(plan: _Plan, rec: StepRecord, path: tuple[str, ...], what: str, stored: Any, live: Any) -> bool:
    if not _check_tensor(plan, rec, what, stored, live):
        plan.skipped.add(path)
        return False
    if is_dtensor(live):
        box, wrap = _local_box(live)
        plan.add(path, stored.name, box, wrap)
    else:
        plan.add(path, stored.name)
    return True


def _plan_model(plan: _Plan, rec: StepRecord, tree: Any, model: torch.nn.Module) -> None:
    if not isinstance(tree, dict):
        plan.problems.append("model: the step has no model state")
        return
    stored = _stored_tree(tree)
    live = model.state_dict()
    missing = [k for k in live if k not in stored]
    unexpected = [k for k in stored if k not in live]
    if missing:
        plan.problems.append(f"model: missing keys {_short(missing)}")
    if unexpected:
        plan.problems.append(f"model: unexpected keys {_short(unexpected)}")
    for k, v in live.items():
        if k in stored and isinstance(v, torch.Tensor):
            _plan_tensor(plan, rec, ("model", k), f"model/{k}", stored[k], v)
        elif k in stored and isinstance(stored[k], Stored):
            plan.add(("model", k), stored[k].name)


def _plan_optimizer(plan: _Plan, rec: StepRecord, tree: Any, optimizer: torch.optim.Optimizer,
                    model: torch.nn.Module | None) -> None:
    if not isinstance(tree, dict) or not isinstance(tree.get(PARAM_GROUPS), list):
        plan.problems.append("optim: the step has no optimizer state")
        return
    names = _param_names(optimizer, model)
    params = {n: p for n, p in zip(names, (p for g in optimizer.param_groups for p in g["params"]))}
    stored = _stored_tree(tree)
    groups = stored[PARAM_GROUPS]
    if len(groups) != len(optimizer.param_groups):
        plan.problems.append(
            f"optim: stored optimizer has {len(groups)} param groups, live one has {len(optimizer.param_groups)}"
        )
    if groups and isinstance(groups[0], dict) and optimizer.param_groups:
        sk = set(groups[0]) - {"params", "param_names"}
        lk = set(optimizer.param_groups[0]) - {"params", "param_names"}
        if sk - lk and lk - sk:  # (one-sided differences are torch versions adding options)
            plan.problems.append(
                f"optim: stored param groups have {_short(sorted(sk - lk))} where the live optimizer has "
                f"{_short(sorted(lk - sk))}: a different optimizer type"
            )
            plan.skipped.add(("optim",))
    live_groups = _group_names(optimizer, names)
    for i, (sg, lg) in enumerate(zip(groups, live_groups)):
        sp = list(sg.get("params", [])) if isinstance(sg, dict) else []
        missing = [n for n in lg if n not in sp]
        unexpected = [n for n in sp if n not in lg]
        if missing:
            plan.problems.append(f"optim: group {i} missing parameters {_short(missing)}")
        if unexpected:
            plan.problems.append(f"optim: group {i} unexpected parameters {_short(unexpected)}")
    for pname, st in stored.items():
        if pname == PARAM_GROUPS or pname not in params or not isinstance(st, dict):
            continue
        p = params[pname]
        for key, v in st.items():
            if not isinstance(v, Stored):
                continue
            e = rec.by_name.get(v.name)
            what = f"optim/{pname}/{key}"
            path = ("optim", pname, key)
            if e is None:
                plan.problems.append(f"{what}: tensor missing from the step index")
                plan.skipped.add(path)
            elif _per_element(e.shape, tuple(p.shape)) and torch_dtype(e.dtype).is_floating_point:
                # Per-element state (exp_avg, momentum_buffer...): same shape and dtype as the param.
                _plan_tensor(plan, rec, path, what, v, p)
            else:  # scalars (step) and factored state (Adafactor's row/col variances): read whole
                plan.add(path, v.name)


def _per_element(stored: tuple[int, ...], param: tuple[int, ...]) -> bool:
    """Is a stored optimizer-state tensor meant to have its parameter's shape?
    Yes when it has it, or the same number of elements (a reshaped
    parameter), or the same rank with sizes that are neither the
    parameter's nor 1; no for scalars and factored state (sizes 1 where the
    parameter's are not)."""
    if not param or not stored:
        return False
    if math.prod(stored) == math.prod(param):
        return True
    return len(stored) == len(param) and any(s not in (q, 1) for s, q in zip(stored, param))


def _group_names(optimizer: torch.optim.Optimizer, names: list[str]) -> list[list[str]]:
    out, i = [], 0
    for g in optimizer.param_groups:
        out.append(names[i: i + len(g["params"])])
        i += len(g["params"])
    return out


def _plan_scheduler(plan: _Plan, tree: Any, scheduler: Any) -> None:
    if not isinstance(tree, dict):
        plan.problems.append("scheduler: the step has no scheduler state")
        return
    live = scheduler.state_dict()
    missing = [k for k in live if k not in tree]
    unexpected = [k for k in tree if k not in live]
    if missing:
        plan.problems.append(f"scheduler: missing keys {_short(missing)}")
    if unexpected:
        plan.problems.append(f"scheduler: unexpected keys {_short(unexpected)}")
    if missing or unexpected:
        plan.skipped.add(("scheduler",))  # a different scheduler: strict=False leaves it as is


def _short(keys: list[str], n: int = 5) -> str:
    shown = ", ".join(repr(k) for k in keys[:n])
    return f"[{shown}{', ...' if len(keys) > n else ''}] ({len(keys)})" if len(keys) > n else f"[{shown}]"


# ----------------------------------------------------------------------------- reading


def read_whole(run: TensorReader, rec: StepRecord, name: str) -> torch.Tensor:
    """A whole tensor of a step, into a tensor that owns exactly its bytes (it
    may be saved or kept by an optimizer); uncompressed local chunks are read
    straight into it (:func:`dstt.format.chunks.read_whole_into`)."""
    e = rec.by_name.get(name)
    if e is None:
        return run.read(name, rec.step, branch=rec.branch)
    buf = torch.empty(e.nbytes, dtype=torch.uint8)
    with run.removed_meanwhile(rec.branch, rec.step):  # pruned meanwhile: StepNotFoundError
        read_whole_into(run.backend, e, buf.numpy().data)
    return buf.view(torch_storage(e.dtype)).view(torch_dtype(e.dtype)).reshape(e.shape)


def _read_all(read: ReadTensor, plan: _Plan, threads: int) -> dict[tuple[str, ...], Any]:
    """Read every planned tensor (only each rank's box) before anything is applied."""
    items = list(plan.loads.items())

    def one(item: tuple[tuple[str, ...], _Load]) -> tuple[tuple[str, ...], Any]:
        path, ld = item
        return path, ld.wrap(read(ld.name, ld.box))

    if threads <= 1 or len(items) <= 1:
        return dict(map(one, items))
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dstt-restore") as pool:
        return dict(pool.map(one, items))


def _small_reader(read: ReadTensor) -> Callable[[Stored], Any]:
    """Reads a small unplanned tensor (RNG state, extra) whole."""
    def one(s: Stored) -> Any:
        t = read(s.name, None)
        return t.numpy() if s.kind == "ndarray" else t

    return one


def _materialize(tree: Any, path: tuple[str, ...], data: dict[tuple[str, ...], Any],
                 read: Callable[[Stored], Any], skipped: AbstractSet[tuple[str, ...]] = frozenset()) -> Any:
    """Decode a subtree, taking planned tensors from ``data``, reading the
    rest, and :data:`SKIPPED` for the tensors that do not fit."""
    def walk(v: Any, p: tuple[str, ...]) -> Any:
        if isinstance(v, Stored):
            if p in skipped:
                return SKIPPED
            return data[p] if p in data else read(v)
        if isinstance(v, dict):
            return {k: walk(x, p + (str(k),)) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x, p + (str(i),)) for i, x in enumerate(v)]
        if isinstance(v, tuple):
            return tuple(walk(x, p + (str(i),)) for i, x in enumerate(v))
        return v

    return walk(_stored_tree(tree), path)


# ----------------------------------------------------------------------------- applying


def _apply_model(model: torch.nn.Module, stored: dict[str, Any], strict: bool) -> None:
    live = model.state_dict()
    sd = {k: v for k, v in stored.items() if k in live and v is not SKIPPED}
    with torch.no_grad():
        model.load_state_dict(sd, strict=strict and set(sd) == set(live))


def _apply_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None, stored: dict[str, Any]) -> None:
    names = _param_names(optimizer, model)
    index = {n: i for i, n in enumerate(names)}
    state: dict[int, dict[str, Any]] = {}
    for pname, st in stored.items():
        if pname == PARAM_GROUPS or pname not in index or not isinstance(st, dict) or not st:
            continue
        if any(v is SKIPPED for v in st.values()):
            continue  # a tensor that does not fit (strict=False): the parameter starts with fresh state
        state[index[pname]] = st
    live_groups = optimizer.state_dict()["param_groups"]
    sgroups = stored[PARAM_GROUPS]
    groups = []
    i = 0
    for gi, lg in enumerate(live_groups):
        g = dict(sgroups[gi]) if gi < len(sgroups) and isinstance(sgroups[gi], dict) else dict(lg)
        n = len(lg["params"])
        g["params"] = list(range(i, i + n))
        g.pop("param_names", None)  # the stored order need not be the live one
        if "param_names" in lg:
            g["param_names"] = names[i: i + n]
        i += n
        groups.append(g)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _own_rng(tree: Any) -> Any:
    """Of a step's per-rank RNG states (``rng/rank<r>``), this rank's alone:
    the others are not read (a collective rewind from memory has only its
    own rank's in its ring). Anything else as it is."""
    if not isinstance(tree, dict) or not any(isinstance(k, str) and k.startswith("rank") and k[4:].isdigit()
                                             for k in tree):
        return tree
    key = f"rank{_rank()[0]}"
    return {key: tree[key]} if key in tree else tree  # (none of this rank's: _apply_rng warns)


def _apply_rng(tree: Any) -> None:
    """Set this process's RNG states; under torch.distributed, rank r takes
    ``rng/rank<r>`` when the step has one (a rank the capture did not have
    keeps its state, with a warning)."""
    if not isinstance(tree, dict):
        return
    per_rank = [k for k in tree if isinstance(k, str) and k.startswith("rank") and k[4:].isdigit()]
    if per_rank:
        rank, _world = _rank()
        key = f"rank{rank}"
        if key not in tree:
            warnings.warn(
                f"the step holds RNG states of {len(per_rank)} ranks, none for rank {rank}; "
                "its RNG state is left as is", RestoreWarning, stacklevel=3,
            )
            return
        tree = tree[key]
    set_rng_state(tree)


__all__ = ["restore", "apply_step", "store_read", "branch", "mismatch_error", "Stored"]
