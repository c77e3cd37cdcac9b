"""The synchronous top-level API: ``dstt.save`` and ``dstt.open``."""

from __future__ import annotations

from typing import Any

from dstt.store.reader import Run
from dstt.store.writer import CommitInfo, Writer


def save(
    store: Any,
    step: int,
    state: Any,
    *,
    branch: str = "main",
    allow_pickle: bool = False,
    compression: str = "none",
    parent: tuple[str, int] | None = None,
) -> CommitInfo:
    """Save ``state`` as ``step`` of ``branch``, durably and atomically.

    ``state`` is a nested dict of tensors (plain, DTensor or
    :class:`dstt.ShardedTensor`) and plain values, e.g. what
    :func:`dstt.state_of` builds. Under torch.distributed every rank calls it;
    each writes its own shards and rank 0 commits.

    >>> import tempfile, torch, dstt
    >>> path = tempfile.mkdtemp() + "/run"
    >>> info = dstt.save(path, 0, {"model": {"w": torch.ones(2)}, "lr": 0.1})
    >>> info.n_tensors, dstt.open(path).state_dict(0)["lr"]
    (1, 0.1)
    """
    with Writer(store, branch=branch, parent=parent, allow_pickle=allow_pickle, compression=compression) as w:
        return w.write(step, state)


def open(store: Any) -> Run:  # noqa: A001 - mirrors zarr.open / builtins.open naming
    """Open a store (path, URL or zarr Store) read-only.

    >>> import tempfile, torch, dstt
    >>> path = tempfile.mkdtemp() + "/run"
    >>> _ = dstt.save(path, 5, {"w": torch.zeros(1)})
    >>> dstt.open(path).steps()
    [5]
    """
    return Run(store)
