"""The value tree of a step (``objects`` in index.json): the one module that
walks it without decoding it (torch-free format layer).

The tree is JSON with type tags (docs/format.md; encoded and decoded by
:mod:`dstt.store.tree`). Readers that only need to know something about a
tree -- is it too deep, which tensors does it name, does it hold a pickle
-- walk it here, iteratively (a hostile tree cannot exhaust the stack) and
without ever decoding a ``$pickle``.

>>> tree = {"model": {"w": {"$tensor": "model/w"}}, "cfg": [{"$pickle": "..."}, 3]}
>>> tensor_refs(tree), has_pickle(tree)
(['model/w'], True)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dstt.errors import CorruptStoreError

#: Deepest value tree (JSON nesting of ``objects``) a reader decodes. An
#: explicit bound, not Python's recursion limit (which differs between
#: versions: 3.12 decodes trees 3.11 refused). Writers refuse states nested
#: more than MAX_STATE_DEPTH containers (tree.flatten), at most 3 JSON
#: levels each ({"$dict": [[key, value]]}) plus a tagged leaf, so every tree
#: dstt writes fits.
MAX_TREE_DEPTH = 256
#: Deepest state (containers inside containers) a writer takes.
MAX_STATE_DEPTH = 64


def check_tree_depth(tree: Any, where: str, limit: int = MAX_TREE_DEPTH) -> None:
    """CorruptStoreError if ``tree`` nests deeper than ``limit`` (iterative:
    never recurses, whatever the depth).

    >>> check_tree_depth({"a": [[1]]}, "x", limit=3)
    >>> check_tree_depth({"a": [[[1]]]}, "x", limit=3)
    Traceback (most recent call last):
    dstt.errors.CorruptStoreError: x: value tree nested more than 3 levels deep
    """
    # Level by level: the nodes at depth d, then their children (one list
    # per level, not a (node, depth) pair per node: trees of 100,000
    # tensors, issue 16).
    level: list[Any] = [tree]
    depth = 0
    while level:
        nxt: list[Any] = []
        for v in level:
            if isinstance(v, dict):
                nxt.extend(v.values())
            elif isinstance(v, list):
                nxt.extend(v)
            else:
                continue
            if depth >= limit:
                raise CorruptStoreError(f"{where}: value tree nested more than {limit} levels deep")
        level = nxt
        depth += 1

#: Tags whose argument names a logical tensor of the step.
TENSOR_TAGS = ("$tensor", "$ndarray")
PICKLE_TAG = "$pickle"


def tagged_leaves(tree: Any) -> Iterator[tuple[str, Any]]:
    """``(tag, argument)`` of every tagged leaf (``{"$tag": arg}``) of a tree,
    depth first; the arguments of ``$tensor``/``$ndarray``/``$pickle`` are
    not walked into, every other node is."""
    stack = [tree]
    while stack:
        v = stack.pop()
        if isinstance(v, list):
            stack.extend(reversed(v))
        elif isinstance(v, dict):
            if len(v) == 1:
                ((tag, arg),) = v.items()
                if isinstance(tag, str) and tag.startswith("$"):
                    yield tag, arg
                    if tag in TENSOR_TAGS or tag == PICKLE_TAG:
                        continue
            stack.extend(reversed(list(v.values())))


def tensor_refs(tree: Any) -> list[str]:
    """Tensor names a value tree refers to (``$tensor``/``$ndarray``), in tree order."""
    return [arg for tag, arg in tagged_leaves(tree) if tag in TENSOR_TAGS and isinstance(arg, str)]


def has_pickle(tree: Any) -> bool:
    """True when a value tree holds a ``$pickle`` leaf (reading it needs ``allow_pickle``)."""
    return any(tag == PICKLE_TAG for tag, _ in tagged_leaves(tree))
