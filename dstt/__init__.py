"""dstt: capture a PyTorch training run at nearly every iteration and travel
through it afterwards (list, inspect, diff, trace, restore, branch).

>>> import tempfile, torch, dstt
>>> m = torch.nn.Linear(4, 2)
>>> path = tempfile.mkdtemp() + "/run"
>>> _ = dstt.save(path, 0, dstt.state_of(model=m))
>>> torch.equal(dstt.open(path).state_dict(0)["model"]["weight"], m.weight)
True
"""

from __future__ import annotations

__version__ = "0.1.0"

from dstt.api import open, save
from dstt.capture import Capture
from dstt.errors import *  # noqa: F401,F403 - the exception hierarchy is public API
from dstt.errors import DsttError
from dstt.export import export
from dstt.restore import branch, restore
from dstt.state import optimizer_state, rng_state, state_of
from dstt.store.reader import Run, TensorInfo
from dstt.store.shards import ShardedTensor
from dstt.store.writer import CommitInfo, Writer

__all__ = [
    "__version__",
    "save",
    "Capture",
    "open",
    "state_of",
    "optimizer_state",
    "rng_state",
    "Run",
    "TensorInfo",
    "ShardedTensor",
    "Writer",
    "CommitInfo",
    "DsttError",
    "restore",
    "branch",
    "export",
]
