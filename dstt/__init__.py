"""dstt: capture a PyTorch training run at nearly every iteration and travel
through it afterwards (list, inspect, diff, trace, restore, branch).

Importing ``dstt`` is cheap: every name below is loaded on first use
(PEP 562), so a read-only tool that touches only the store's index never
imports torch.

>>> import tempfile, torch, dstt
>>> m = torch.nn.Linear(4, 2)
>>> path = tempfile.mkdtemp() + "/run"
>>> _ = dstt.save(path, 0, dstt.state_of(model=m))
>>> torch.equal(dstt.open(path).state_dict(0)["model"]["weight"], m.weight)
True
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dstt import errors as _errors
from dstt._version import __version__
from dstt.errors import *  # noqa: F401,F403 - the exception hierarchy is public API (torch-free)

#: Public name -> module defining it (imported on first access).
_LAZY: dict[str, str] = {
    "save": "dstt.api",
    "open": "dstt.api",
    "Run": "dstt.api",
    "Capture": "dstt.capture",
    "CaptureConfig": "dstt.capture",
    "state_of": "dstt.store.state",
    "optimizer_state": "dstt.store.state",
    "rng_state": "dstt.store.state",
    "TensorInfo": "dstt.format.index",
    "StepRef": "dstt.format.refs",
    "Ref": "dstt.format.refs",
    "ShardedTensor": "dstt.store.shards",
    "Writer": "dstt.store.writer",
    "CommitInfo": "dstt.store.writer",
    "restore": "dstt.timetravel.restore",
    "branch": "dstt.timetravel.restore",
    "export": "dstt.timetravel.export",
    "verify": "dstt.format.verify",
    "prune": "dstt.format.gc",
    "gc": "dstt.api",
    "resume": "dstt.api",
    "Resumed": "dstt.api",
    "to_dask": "dstt.integrations.dask",
    "to_xarray": "dstt.integrations.dask",
}

_EXCEPTIONS = [n for n, v in vars(_errors).items()
               if isinstance(v, type) and issubclass(v, BaseException) and v.__module__ == _errors.__name__]

__all__ = ["__version__", *_LAZY, *_EXCEPTIONS]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dstt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # what type checkers and IDEs see ("X as X": re-exported)
    from dstt.api import Run as Run
    from dstt.api import gc as gc
    from dstt.api import open as open
    from dstt.api import save as save
    from dstt.capture import Capture as Capture
    from dstt.capture import CaptureConfig as CaptureConfig
    from dstt.format.commit import CommitInfo as CommitInfo
    from dstt.format.gc import prune as prune
    from dstt.format.index import TensorInfo as TensorInfo
    from dstt.format.refs import Ref as Ref
    from dstt.format.refs import StepRef as StepRef
    from dstt.format.verify import verify as verify
    from dstt.integrations.dask import to_dask as to_dask
    from dstt.integrations.dask import to_xarray as to_xarray
    from dstt.store.shards import ShardedTensor as ShardedTensor
    from dstt.store.state import optimizer_state as optimizer_state
    from dstt.store.state import rng_state as rng_state
    from dstt.store.state import state_of as state_of
    from dstt.store.writer import Writer as Writer
    from dstt.timetravel.export import export as export
    from dstt.timetravel.restore import branch as branch
    from dstt.timetravel.restore import restore as restore
