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


if TYPE_CHECKING:  # what type checkers and IDEs see
    from dstt.api import Run, gc, open, save  # noqa: F401
    from dstt.capture import Capture, CaptureConfig  # noqa: F401
    from dstt.format.gc import prune  # noqa: F401
    from dstt.format.index import TensorInfo  # noqa: F401
    from dstt.format.refs import Ref, StepRef  # noqa: F401
    from dstt.format.verify import verify  # noqa: F401
    from dstt.integrations.dask import to_dask, to_xarray  # noqa: F401
    from dstt.store.shards import ShardedTensor  # noqa: F401
    from dstt.store.state import optimizer_state, rng_state, state_of  # noqa: F401
    from dstt.store.writer import CommitInfo, Writer  # noqa: F401
    from dstt.timetravel.export import export  # noqa: F401
    from dstt.timetravel.restore import branch, restore  # noqa: F401
