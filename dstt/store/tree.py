"""Nested state ⇄ (JSON tree, named tensors).

A state is a nested structure of dicts, lists and tuples whose leaves are
tensors or plain values. Tensors become *logical tensors* named by their path
(``model/layers.0.weight``); everything else is kept in a JSON tree with type
tags so Python types round-trip exactly:

=================  ==========================================
value              JSON
=================  ==========================================
None/bool/int/str  as is
float              as is; non-finite as ``{"$float": "nan"}``
tuple              ``{"$tuple": [...]}``
dict, str keys     as is (keys starting with ``$`` force the next form)
other dict         ``{"$dict": [[key, value], ...]}``
bytes              ``{"$bytes": "<base64>"}``
torch.dtype        ``{"$dtype": "float32"}``
numpy scalar       ``{"$np": ["int64", 3]}`` (``np.float64`` included)
tensor             ``{"$tensor": "<name>"}``
numpy array        ``{"$ndarray": "<name>"}`` (dtypes torch has)
other (opt-in)     ``{"$pickle": "<base64>"}``
=================  ==========================================

Scalars are matched by exact type: a subclass of int, float or str
(``IntEnum``, ``StrEnum``, ``np.str_``) would come back as its base type, so
it is "other" (refused without ``allow_pickle=True``). Containers are
matched by ``isinstance``: ``OrderedDict``/``defaultdict`` come back as
``dict``, ``torch.Size`` and namedtuples as ``tuple``, ``bytearray`` as
``bytes`` -- their tensors must stay logical tensors, not vanish in a pickle.

Nothing is unpickled unless the reader passes ``allow_pickle=True``.
"""

from __future__ import annotations

import base64
import itertools
import math
import operator
import pickle
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from dstt.errors import (
    CorruptStoreError,
    InvalidNameError,
    PickleNotAllowedError,
    UnsupportedValueError,
)
from dstt.format.valuetree import (
    MAX_STATE_DEPTH,
    PICKLE_TAG,
    TENSOR_TAGS,
    check_tree_depth,
    has_pickle,
    tagged_leaves,
)
from dstt.store.shards import ShardedTensor, is_dtensor

TensorLike = Any  # torch.Tensor | DTensor | ShardedTensor | np.ndarray

#: numpy scalars stored with their dtype (complex has no JSON form: pickle only).
_NP_SCALARS = (np.integer, np.floating, np.bool_)
#: Leaves stored as themselves. Exact types: subclasses would lose their type.
_JSON_SCALARS = (type(None), bool, int, str)
_JSON_SCALAR_SET = frozenset(_JSON_SCALARS)
_TORCH_DTYPES = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


def escape_name_part(part: str) -> str:
    """A dict key as a tensor-name component: '%' and '/' are percent-encoded."""
    return part.replace("%", "%25").replace("/", "%2F")


def _is_tensor(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, ShardedTensor)) or is_dtensor(v)


def flatten(state: Any, *, allow_pickle: bool = False, memo: dict[str, Any] | None = None,
            ) -> tuple[Any, dict[str, TensorLike], dict[str, str]]:
    """Split ``state`` into a JSON-able tree, its tensors by name and their kinds.

    ``memo`` (a dict the caller keeps across calls, e.g. one per writer):
    a dict of string keys whose values are all plain tensors, at the same
    place and with the same keys (in order) as in the previous call, gets
    the previous call's subtree back (the same object: treat the tree as
    read-only) instead of a new one built key by key (issue 16: tens of
    thousands of tensors per step); so does a dict whose first values are
    such dicts (an optimizer's state by parameter, then its param_groups),
    with its other values encoded again (issue 25: one Python call per
    parameter was most of flattening an AdamW state). The names, tensors
    and errors are the same as without it.

    >>> tree, tensors, kinds = flatten({"w": torch.zeros(2), "lr": 0.1})
    >>> tree, list(tensors)
    ({'w': {'$tensor': 'w'}, 'lr': 0.1}, ['w'])
    >>> memo = {}
    >>> a = flatten({"m": {"w": torch.zeros(2)}}, memo=memo)[0]
    >>> b = flatten({"m": {"w": torch.ones(2)}}, memo=memo)[0]
    >>> a == b, a["m"] is b["m"]
    (True, True)
    """
    tensors: dict[str, TensorLike] = {}
    # Kinds other than "tensor", by name (the kinds are made in one pass at
    # the end: most tensors are plain ones, named a container at a time).
    odd_kinds: dict[str, str] = {}
    # Subtrees of all-tensor dicts by their name prefix: the previous call's
    # (read) and this call's (kept for the next one, once this call succeeds).
    seen: dict[str, tuple[list[str], list[str], dict[str, Any]]] | None = None if memo is None else {}
    prev: dict[str, tuple[list[str], list[str], dict[str, Any]]] = {} if memo is None else memo.get("dicts", {})
    # Dicts whose first values are all-tensor dicts, by name prefix (see _Nested).
    seen_nested: dict[str, _Nested] = {}
    prev_nested: dict[str, _Nested] = {} if memo is None else memo.get("nested", {})

    def add(path: list[str], value: Any, kind: str) -> str:
        if not path:
            raise InvalidNameError("the state itself must be a dict or list, not a bare tensor")
        return add_named("/".join(path), value, kind)

    def add_named(name: str, value: Any, kind: str) -> str:
        if name in tensors:
            raise InvalidNameError(
                f"two tensors map to the name {name!r}; rename one of the keys"
            )
        tensors[name] = value
        if kind != "tensor":
            odd_kinds[name] = kind
        return name

    def enc(v: Any, path: list[str]) -> Any:
        if type(v) in _JSON_SCALARS:
            return v
        if type(v) is float:  # np.float64, a float subclass, is a numpy scalar below
            return v if math.isfinite(v) else {"$float": repr(v)}
        if _is_tensor(v):
            return {"$tensor": add(path, v, "tensor")}
        if isinstance(v, np.ndarray):
            t = _ndarray_as_tensor(v)
            if t is None:
                return _maybe_pickle(v, path, allow_pickle)
            return {"$ndarray": add(path, t, "ndarray")}
        if isinstance(v, (dict, list, tuple)):
            return enc_container(v, path)
        if isinstance(v, (bytes, bytearray)):
            return {"$bytes": base64.b64encode(bytes(v)).decode("ascii")}
        if isinstance(v, torch.dtype):
            return {"$dtype": str(v).removeprefix("torch.")}
        if isinstance(v, _NP_SCALARS):
            item = v.item()
            # Only scalars whose .item() is a plain Python number round-trip
            # through JSON; np.longdouble's .item() is itself (enc would recurse
            # forever), and it has no exact Python form anyway.
            if type(item) not in (bool, int, float):
                return _maybe_pickle(v, path, allow_pickle)
            return {"$np": [v.dtype.name, enc(item, path)]}
        return _maybe_pickle(v, path, allow_pickle)

    active: set[int] = set()  # ids of the containers on the path being encoded

    def enc_container(v: Any, path: list[str]) -> Any:
        # Refused up front with a clear error instead of a RecursionError:
        # a cycle, and nesting beyond what readers decode (MAX_STATE_DEPTH).
        if id(v) in active:
            raise UnsupportedValueError(
                f"at {_where(path)}: the state contains itself (a reference cycle); it cannot be stored")
        if len(active) >= MAX_STATE_DEPTH:
            raise UnsupportedValueError(
                f"at {_where(path)}: the state is nested more than {MAX_STATE_DEPTH} containers deep")
        active.add(id(v))
        try:
            if isinstance(v, dict):
                prefix = "/".join(path) + "/" if path else ""
                if seen is not None:  # (before the keys' check: a hit's keys are those checked then)
                    known = enc_tensor_dict(v, prefix)
                    if known is None:
                        known = enc_nested(v, prefix, path)
                    if known is not None:
                        return known
                str_keys = all(isinstance(k, str) and not k.startswith("$") for k in v)
                if str_keys:
                    # A plain tensor value (exact torch.Tensor: never a DTensor)
                    # is named here, without a path list per key (issue 16:
                    # tens of thousands of tensors per step).
                    out: dict[str, Any] = {}
                    leading: list[str] = []  # the keys of the all-tensor dicts that come first
                    for k, x in v.items():
                        part = escape_name_part(k) if "%" in k or "/" in k else k
                        tx = type(x)
                        if tx is torch.Tensor:
                            out[k] = {"$tensor": add_named(prefix + part, x, "tensor")}
                            continue
                        if tx is dict and seen is not None and len(active) < MAX_STATE_DEPTH:
                            # (a dict of plain tensors, e.g. an optimizer's state of
                            # one parameter, holds no container: no cycle, one level)
                            known = enc_tensor_dict(x, prefix + part + "/")
                            if known is not None:
                                out[k] = known
                                if len(leading) == len(out) - 1:
                                    leading.append(k)
                                continue
                        out[k] = enc(x, path + [part])
                    if len(leading) > 1 and seen is not None:
                        inner = [seen[prefix + (escape_name_part(k) if "%" in k or "/" in k else k) + "/"]
                                 for k in leading]
                        seen_nested[prefix] = _Nested(list(v), leading, [e[0] for e in inner],
                                                      [n for e in inner for n in e[1]], out)
                    return out
                return {"$dict": [[enc_key(k, path), enc(x, path + [escape_name_part(str(k))])]
                                  for k, x in v.items()]}
            if set(map(type, v)) <= _JSON_SCALAR_SET:  # (each as is: one C-level pass, e.g. random.getstate())
                items = list(v)
            else:
                items = [enc(x, path + [str(i)]) for i, x in enumerate(v)]
            return items if isinstance(v, list) else {"$tuple": items}
        finally:
            active.discard(id(v))

    def enc_key(k: Any, path: list[str]) -> Any:
        if _is_tensor(k) or isinstance(k, (dict, list, np.ndarray)):
            raise UnsupportedValueError(f"at {'/'.join(path) or '<root>'}: unsupported dict key type {type(k).__name__}")
        return enc(k, path)

    def enc_tensor_dict(v: dict[str, Any], prefix: str) -> dict[str, Any] | None:
        """The subtree of ``v`` (string keys, none starting with '$') when
        all its values are plain tensors, from the memo when it holds one for
        this place and these keys, else built; None when a value is not a
        plain tensor (then the caller encodes it key by key)."""
        values = list(v.values())
        if not values or not all(map(operator.is_, map(type, values), itertools.repeat(torch.Tensor))):
            return None
        keys = list(v)
        hit = prev.get(prefix)
        if hit is not None and hit[0] == keys:  # (keys checked when remembered)
            names, out = hit[1], hit[2]
        else:
            if not all(isinstance(k, str) and not k.startswith("$") for k in keys):
                return None
            names = [prefix + (escape_name_part(k) if "%" in k or "/" in k else k) for k in keys]
            out = {k: {"$tensor": n} for k, n in zip(keys, names)}
        # Distinct keys give distinct names here (escaping is one-to-one);
        # another container may have given one already: then the whole state
        # is flattened again without the memo, which names the clash.
        before = len(tensors)
        tensors.update(zip(names, values))
        if len(tensors) != before + len(names):
            raise _NameClash
        assert seen is not None
        seen[prefix] = (keys, names, out)
        return out

    def enc_nested(v: dict[str, Any], prefix: str, path: list[str]) -> dict[str, Any] | None:
        """The subtree of ``v`` (string keys, none starting with '$') from
        the memo when the previous call saw a dict at this place with the
        same keys, the same leading all-tensor dicts (the same keys each,
        plain tensors still): those and their names as then, each other
        value encoded again. None otherwise (encoded key by key)."""
        hit = prev_nested.get(prefix)
        if hit is None or len(active) >= MAX_STATE_DEPTH or list(v) != hit.keys:
            return None
        inner = list(map(v.__getitem__, hit.leading))
        if not all(map(operator.is_, map(type, inner), itertools.repeat(dict))) or \
                list(map(list, inner)) != hit.inner_keys:
            return None
        values = list(itertools.chain.from_iterable(map(dict.values, inner)))
        if not all(map(operator.is_, map(type, values), itertools.repeat(torch.Tensor))):
            return None
        before = len(tensors)
        tensors.update(zip(hit.names, values))
        if len(tensors) != before + len(values):
            raise _NameClash
        out = dict(hit.out)  # (the leading subtrees: the same objects, read-only)
        for k in hit.keys[len(hit.leading):]:
            x = v[k]
            part = escape_name_part(k) if "%" in k or "/" in k else k
            out[k] = {"$tensor": add_named(prefix + part, x, "tensor")} if type(x) is torch.Tensor else \
                enc(x, path + [part])
        seen_nested[prefix] = hit
        return out

    try:
        tree = enc(state, [])
    except _NameClash:
        return flatten(state, allow_pickle=allow_pickle)  # (raises InvalidNameError naming the clash)
    if memo is not None and seen is not None:
        memo["dicts"] = seen
        memo["nested"] = seen_nested
    kinds = dict.fromkeys(tensors, "tensor")
    if odd_kinds:
        kinds.update(odd_kinds)
    return tree, tensors, kinds


class _Nested(NamedTuple):
    """A dict flatten saw whose first values were all-tensor dicts: its
    keys, those leading keys, each one's keys, their tensors' names (in
    order) and the subtree made (the leading keys' subtrees reused)."""

    keys: list[str]
    leading: list[str]
    inner_keys: list[list[str]]
    names: list[str]
    out: dict[str, Any]


class _NameClash(Exception):
    """Two tensors of a memoized dict got one name (flatten raises the
    InvalidNameError of the memo-free walk instead)."""


def _where(path: list[str]) -> str:
    """A path for messages: shortened when deep."""
    if not path:
        return "<root>"
    return "/".join(path) if len(path) <= 8 else "/".join(path[:4]) + "/.../" + "/".join(path[-2:])


def _ndarray_as_tensor(v: np.ndarray) -> torch.Tensor | None:
    """``v`` as a tensor of the same shape and bytes, or None where torch has
    no such dtype (objects, strings, datetimes, records, float128, non-native
    byte order)."""
    if v.dtype == object:
        return None
    try:
        t = torch.from_numpy(np.ascontiguousarray(v))
    except (TypeError, ValueError):
        return None
    return t.reshape(v.shape)  # ascontiguousarray turns a 0-d array into a 1-d one


def _maybe_pickle(v: Any, path: list[str], allow_pickle: bool) -> Any:
    where = "/".join(path) or "<root>"
    if not allow_pickle:
        what = f"{type(v).__module__}.{type(v).__qualname__}"
        if isinstance(v, np.ndarray):
            what += f" of dtype {v.dtype}"
        raise UnsupportedValueError(
            f"at {where}: cannot store a {what} without pickle; pass allow_pickle=True to store it pickled"
        )
    try:
        data = pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise UnsupportedValueError(f"at {where}: value cannot be pickled: {e}") from None
    return {"$pickle": base64.b64encode(data).decode("ascii")}


def unflatten(tree: Any, load: Callable[[str, str], Any], *, allow_pickle: bool = False,
              depth_checked: bool = False) -> Any:
    """Rebuild the state from a JSON tree; ``load(name, kind)`` supplies tensors.
    ``depth_checked``: the caller has checked the tree's depth already
    (valuetree.check_tree_depth: parse_index does, for a step's tree)."""

    def bad(what: str) -> CorruptStoreError:
        return CorruptStoreError(f"malformed value tree: {what}")

    def dec(v: Any) -> Any:
        t = type(v)  # exact types first: what JSON gives (the common case)
        if t is dict and len(v) == 1:
            (tag, arg), = v.items()
            if type(tag) is str and tag.startswith("$"):
                return dec_tag(tag, arg)
        elif t is str or t is int or t is float:
            return v
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [dec(x) for x in v]
        if not isinstance(v, dict):
            raise bad(f"unexpected {type(v).__name__}")
        if len(v) == 1:
            (tag, arg), = v.items()
            if tag.startswith("$"):
                return dec_tag(tag, arg)
        for k in v:
            if k.startswith("$"):
                raise bad(f"unexpected tagged key {k!r}")
        return {k: dec(x) for k, x in v.items()}

    def dec_tag(tag: str, arg: Any) -> Any:
        if tag == "$float":
            if arg not in ("nan", "inf", "-inf"):
                raise bad(f"$float {arg!r}")
            return float(arg)
        if tag == "$tuple":
            if not isinstance(arg, list):
                raise bad("$tuple needs a list")
            return tuple(dec(x) for x in arg)
        if tag == "$dict":
            if not isinstance(arg, list) or not all(isinstance(p, list) and len(p) == 2 for p in arg):
                raise bad("$dict needs [key, value] pairs")
            out = {}
            for k, x in arg:
                key = dec(k)
                try:
                    hash(key)
                except TypeError:
                    raise bad("unhashable $dict key") from None
                out[key] = dec(x)
            return out
        if tag == "$bytes":
            if not isinstance(arg, str):
                raise bad("$bytes needs a string")
            try:
                return base64.b64decode(arg, validate=True)
            except ValueError:
                raise bad("$bytes is not base64") from None
        if tag == "$dtype":
            # Look the name up among torch's dtypes only: getattr(torch, name)
            # with a store-chosen name could import arbitrary torch submodules.
            dt = _TORCH_DTYPES.get(arg) if isinstance(arg, str) else None
            if not isinstance(dt, torch.dtype):
                raise bad(f"$dtype {arg!r}")
            return dt
        if tag == "$np":
            if not (isinstance(arg, list) and len(arg) == 2 and isinstance(arg[0], str)):
                raise bad("$np needs [dtype, value]")
            try:
                dtype = np.dtype(arg[0])
            except (TypeError, ValueError):  # ValueError: e.g. an absurd subarray shape
                raise bad(f"$np dtype {arg[0]!r}") from None
            if dtype.kind not in "biufc":
                raise bad(f"$np dtype {arg[0]!r} is not a numeric scalar type")
            value = dec(arg[1])
            if not isinstance(value, (bool, int, float, complex)):
                raise bad(f"$np value must be a number, got {type(value).__name__}")
            try:
                return dtype.type(value)
            except (OverflowError, ValueError, TypeError) as e:
                raise bad(f"$np {arg[0]} value {value!r}: {e}") from None
        if tag in ("$tensor", "$ndarray"):
            if not isinstance(arg, str):
                raise bad(f"{tag} needs a tensor name")
            t = load(arg, "tensor" if tag == "$tensor" else "ndarray")
            return t
        if tag == "$pickle":
            if not allow_pickle:
                raise PickleNotAllowedError(_PICKLE_REFUSED)
            if not isinstance(arg, str):
                raise bad("$pickle needs a string")
            return pickle.loads(base64.b64decode(arg))
        raise bad(f"unknown tag {tag!r}")

    if not depth_checked:
        check_tree_depth(tree, "value tree")  # explicit: not Python's recursion limit
    try:
        return dec(tree)
    except RecursionError:  # (not reached within MAX_TREE_DEPTH)
        raise bad("nested too deeply") from None


_PICKLE_REFUSED = ("the step holds a pickled value; reading it runs code from the store, "
                   "pass allow_pickle=True only for stores you trust")


def tensor_names(tree: Any, *, allow_pickle: bool = False) -> list[str]:
    """The tensors :func:`unflatten` would load from ``tree``, in the order
    it loads them, without building the state (a walk over the tagged
    leaves: a third of unflatten's cost); PickleNotAllowedError up front, as
    unflatten raises it. A malformed tree is refused by unflatten itself.

    >>> tensor_names({"m": {"w": {"$tensor": "m/w"}}, "a": [{"$ndarray": "a/0"}, 3]})
    ['m/w', 'a/0']
    """
    names: list[str] = []
    for tag, arg in tagged_leaves(tree):
        if tag in TENSOR_TAGS:
            if isinstance(arg, str):
                names.append(arg)
        elif tag == PICKLE_TAG and not allow_pickle:
            raise PickleNotAllowedError(_PICKLE_REFUSED)
    return names


def tree_has_pickle(tree: Any) -> bool:
    return has_pickle(tree)
