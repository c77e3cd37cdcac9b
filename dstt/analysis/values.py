"""Non-tensor values of a step -- learning rates and every other
hyperparameter in ``optim/param_groups``, scheduler state, loop counters,
``extra`` values (a loss you stored) -- read from the step index's value
tree (``index.json``; no tensor data, no torch).

A value is named by its path in the tree, like a tensor: dict keys escaped
as in tensor names (``%`` and ``/`` percent-encoded), list and tuple items by
index: ``optim/param_groups/0/lr``, ``scheduler/last_epoch``,
``extra/loss``. A path may name a whole subtree (``optim/param_groups/0``).

>>> import tempfile, torch, dstt
>>> path = tempfile.mkdtemp() + "/run"
>>> m = torch.nn.Linear(2, 1)
>>> for s, lr in enumerate([0.1, 0.1, 10.0]):
...     opt = torch.optim.SGD(m.parameters(), lr=lr)
...     _ = dstt.save(path, s, dstt.state_of(model=m, optimizer=opt, extra={"loss": 1.0 / (s + 1)}))
>>> run = dstt.open(path)
>>> get_value(step_tree(run, 2), "optim/param_groups/0/lr")
10.0
>>> [(r["path"], r["a"], r["b"]) for r in value_diff(step_tree(run, 0), step_tree(run, 2))]
[('optim/param_groups/0/lr', 0.1, 10.0), ('extra/loss', 1.0, 0.3333333333333333)]
>>> [(p["step"], p["value"]) for p in value_history(run, ["optim/param_groups/0/lr"])]
[(0, 0.1), (1, 0.1), (2, 10.0)]
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from dstt.analysis.select import is_glob, match_names
from dstt.errors import ConfigError, TensorNotFoundError

if TYPE_CHECKING:
    from dstt.format.index import RunIndex

#: A list or tuple of more scalars than this is one value ("[625 values]"):
#: RNG states and the like are not spread over hundreds of rows.
MAX_SPREAD = 16
#: Top-level subtrees left out of value diffs unless asked for by a pattern
#: (RNG states change every step and mean nothing to a reader).
NOISY_ROOTS = ("rng",)
#: Display order of the top-level sections (what a reader looks at first).
SECTION_ORDER = ("model", "optim", "scheduler", "extra")


def _escape(part: str) -> str:
    return part.replace("%", "%25").replace("/", "%2F")


def step_tree(run: RunIndex, step: Any = None, branch: str | None = None) -> Any:
    """The raw value tree of a step (JSON with dstt's type tags), without
    its tensor entries (:meth:`RunIndex.value_tree`)."""
    return run.value_tree(step, branch=branch)


def plain(v: Any) -> Any:
    """A raw tree node as plain Python for display: tuples as lists, numpy
    scalars as numbers, tensors as ``"<tensor NAME>"``, bytes and pickles
    described, never decoded.

    >>> plain({"b": {"$tuple": [0.9, {"$float": "inf"}]}, "w": {"$tensor": "model/w"}})
    {'b': [0.9, inf], 'w': '<tensor model/w>'}
    """
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        if len(v) == 1:
            (tag, arg), = v.items()
            if isinstance(tag, str) and tag.startswith("$"):
                return _plain_tag(tag, arg)
        return {str(k): plain(x) for k, x in v.items()}
    return repr(v)


def _plain_tag(tag: str, arg: Any) -> Any:
    if tag == "$float":
        return float(arg) if arg in ("nan", "inf", "-inf") else str(arg)
    if tag == "$tuple":
        return [plain(x) for x in arg] if isinstance(arg, list) else str(arg)
    if tag == "$np":
        return arg[1] if isinstance(arg, list) and len(arg) == 2 else str(arg)
    if tag == "$dtype":
        return f"torch.{arg}"
    if tag == "$dict":
        return {str(plain(k)): plain(x) for k, x in arg} if isinstance(arg, list) else str(arg)
    if tag == "$bytes":
        try:
            return f"<{len(base64.b64decode(arg))} bytes>"
        except (ValueError, TypeError):
            return "<bytes>"
    if tag == "$pickle":
        return "<pickled value (not read)>"
    if tag == "$tensor":
        return f"<tensor {arg}>"
    if tag == "$ndarray":
        return f"<array {arg}>"
    return f"<{tag}>"


def _children(v: Any) -> Iterator[tuple[str, Any]] | None:
    """(path part, child) of a container node; None for a leaf."""
    if isinstance(v, list):
        return ((str(i), x) for i, x in enumerate(v))
    if not isinstance(v, dict):
        return None
    if len(v) == 1:
        (tag, arg), = v.items()
        if isinstance(tag, str) and tag.startswith("$"):
            if tag == "$tuple" and isinstance(arg, list):
                return ((str(i), x) for i, x in enumerate(arg))
            if tag == "$dict" and isinstance(arg, list):
                return ((_escape(str(plain(p[0]))), p[1]) for p in arg if isinstance(p, list) and len(p) == 2)
            return None  # a tagged leaf
    return ((_escape(str(k)), x) for k, x in v.items())


def _is_tensor(v: Any) -> bool:
    return isinstance(v, dict) and len(v) == 1 and next(iter(v)) in ("$tensor", "$ndarray")


def _scalar_run(v: Any) -> bool:
    """A long list/tuple of scalars: kept as one value."""
    items = v.get("$tuple") if isinstance(v, dict) and len(v) == 1 and "$tuple" in v else v
    return (isinstance(items, list) and len(items) > MAX_SPREAD
            and all(x is None or isinstance(x, (bool, int, float, str)) for x in items))


def flatten_values(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Every non-tensor leaf of a (sub)tree as ``{path: plain value}``, in
    tree order. Empty containers are leaves (``{}``/``[]``).

    >>> flatten_values({"optim": {"param_groups": [{"lr": 0.1, "betas": {"$tuple": [0.9, 0.99]}}]}})
    {'optim/param_groups/0/lr': 0.1, 'optim/param_groups/0/betas/0': 0.9, 'optim/param_groups/0/betas/1': 0.99}
    """
    out: dict[str, Any] = {}

    def walk(v: Any, path: str, depth: int) -> None:
        if _is_tensor(v):
            return
        kids = None if depth > 64 or _scalar_run(v) else _children(v)
        if kids is None:
            out[path] = plain(v)
            return
        empty = True
        for part, child in kids:
            empty = False
            walk(child, f"{path}/{part}" if path else part, depth + 1)
        if empty:
            out[path] = plain(v)

    walk(tree, prefix, 0)
    return out


def get_value(tree: Any, path: str) -> Any:
    """The value (or subtree, as plain Python) at ``path``; a path naming a
    tensor gives ``"<tensor NAME>"``. Unknown path: TensorNotFoundError
    with the nearest existing prefix and a suggestion."""
    node = tree
    parts = [p for p in path.strip("/").split("/") if p] if path.strip("/") else []
    for i, part in enumerate(parts):
        kids = _children(node)
        found = None
        if kids is not None:
            for name, child in kids:
                if name == part:
                    found = (child,)
                    break
        if found is None:
            where = "/".join(parts[:i]) or "the step"
            choices = [n for n, _ in (_children(node) or [])]
            from dstt.format.index import suggest

            hint = suggest(part, choices) if choices else ""
            shown = f" (it has: {', '.join(choices[:12])}{', ...' if len(choices) > 12 else ''})" if choices else ""
            raise TensorNotFoundError(f"no tensor or value {path!r}: {where} has no {part!r}{shown}{hint}")
        node = found[0]
    return plain(node)


def has_value(tree: Any, path: str) -> bool:
    """Does ``path`` name a value or subtree (not a tensor) of the tree?"""
    try:
        v = get_value(tree, path)
    except TensorNotFoundError:
        return False
    return not (isinstance(v, str) and v.startswith(("<tensor ", "<array ")))


def _section_rank(path: str) -> int:
    root = path.split("/", 1)[0]
    return SECTION_ORDER.index(root) if root in SECTION_ORDER else len(SECTION_ORDER)


def value_diff(tree_a: Any, tree_b: Any, patterns: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Values that differ between two trees: rows ``{"path", "status"
    (changed/added/removed), "a", "b"}``, hyperparameters and scheduler
    first. ``patterns`` are path globs; RNG states are left out unless a
    pattern asks for them.

    >>> value_diff({"extra": {"lr": 0.1, "n": 1}}, {"extra": {"lr": 10, "n": 1, "k": "x"}})
    [{'path': 'extra/lr', 'status': 'changed', 'a': 0.1, 'b': 10}, {'path': 'extra/k', 'status': 'added', 'a': None, 'b': 'x'}]
    """
    pats = [p for p in (patterns or []) if p]
    fa, fb = flatten_values(tree_a), flatten_values(tree_b)
    rows = []
    for path in list(fa) + [p for p in fb if p not in fa]:
        if not pats and path.split("/", 1)[0] in NOISY_ROOTS:
            continue
        if pats and not match_names([path], pats) and not any(path.startswith(p.rstrip("/") + "/") for p in pats
                                                                if not is_glob(p)):
            continue
        a, b = fa.get(path, _MISSING), fb.get(path, _MISSING)
        if (a is _MISSING or b is _MISSING) and (a, b) in (({}, _MISSING), ([], _MISSING), (_MISSING, {}),
                                                          (_MISSING, [])):
            continue  # an empty container that gained (or lost) entries: the entries are the rows
        if a is _MISSING:
            rows.append({"path": path, "status": "added", "a": None, "b": b})
        elif b is _MISSING:
            rows.append({"path": path, "status": "removed", "a": a, "b": None})
        elif not _same(a, b):
            rows.append({"path": path, "status": "changed", "a": a, "b": b})
    rows.sort(key=lambda r: (_section_rank(r["path"]), 0 if "/param_groups/" in r["path"] else 1))
    return rows


def _same(a: Any, b: Any) -> bool:
    """Equal, with NaN equal to NaN and 1 distinct from 1.0 only by value."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                             and not isinstance(a, bool) and not isinstance(b, bool) and a == b)


_MISSING = object()


def value_history(run: RunIndex, paths: Iterable[str], branch: str | None = None, *,
                  ancestry: bool = True) -> list[dict[str, Any]]:
    """One row ``{"tensor": path, "branch", "step", "value"}`` per value path
    (or glob over value paths) and step of a branch's lineage, from each
    step's value tree (steps without the value are left out). The row key
    is ``tensor`` so value series plot and print like tensor series."""
    pats = [p for p in paths if p]
    if not pats:
        raise ConfigError("history needs at least one tensor name, value path or glob")
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for b, steps in run.lineage(branch, ancestry):
        for s in steps:
            flat = flatten_values(step_tree(run, s, b))
            for path in match_names(list(flat), pats):
                seen.add(path)
                rows.append({"tensor": path, "branch": b, "step": s, "value": flat[path]})
    for p in pats:
        if not any(path == p or (is_glob(p) and match_names([path], [p])) for path in seen):
            raise TensorNotFoundError(f"no value matches {p!r} on branch {branch or run.default_branch!r}")
    return rows


def numeric(v: Any) -> float | None:
    """``v`` as a float where it is a number (bools excluded), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)




def section_sorted(rows: list[dict[str, Any]], key: str = "name") -> list[dict[str, Any]]:
    """Rows (tensor diff rows, by their ``name``) stably regrouped by
    section: model first, then the rest, optimizer state and RNG last.

    >>> [r["name"] for r in section_sorted([{"name": "optim/w/step"}, {"name": "model/w"}, {"name": "rng/torch"}])]
    ['model/w', 'optim/w/step', 'rng/torch']
    """
    order = {"model": 0, "scheduler": 2, "extra": 2, "optim": 3, "rng": 4}
    return sorted(rows, key=lambda r: order.get(str(r[key]).split("/", 1)[0], 1))


__all__ = [
    "flatten_values",
    "get_value",
    "has_value",
    "numeric",
    "plain",
    "section_sorted",
    "step_tree",
    "value_diff",
    "value_history",
]
