"""Which tensors may be staged lazily, and the optimizer hook that keeps it safe.

The consistency rule (docs/capture.md): between ``snapshot()`` and the next
``optimizer.step()`` the optimizer's parameters and its state tensors
(``exp_avg``, ``step``, ...) are only read (forward and backward read
parameters; they write activations and gradients). So those tensors are
copied in the background and the optimizer's step pre-hook waits for that
copy to finish before the first in-place update.

Everything else -- model buffers (BatchNorm's running stats change during
the *next forward*), parameters no optimizer updates, RNG states, user
extras -- has no such fence, so it is staged eagerly inside ``snapshot()``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from dstt.store.shards import is_dtensor


def _local(t: Any) -> torch.Tensor:
    local: torch.Tensor = t.to_local() if is_dtensor(t) else t
    return local


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identifies the memory a tensor (or any view of it) lives in."""
    t = _local(t)
    return (t.device.type, t.untyped_storage().data_ptr())


def optimizer_storages(optimizer: torch.optim.Optimizer) -> set[tuple[str, int]]:
    """Storages only ``optimizer.step()`` mutates: its params and state tensors."""
    keys: set[tuple[str, int]] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            keys.add(storage_key(p))
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                keys.add(storage_key(v))
    return keys


class StepFence:
    """Installs one step pre-hook per optimizer; the hook calls ``wait()``.

    >>> m = torch.nn.Linear(2, 2); opt = torch.optim.SGD(m.parameters(), lr=0.1)
    >>> calls = []
    >>> fence = StepFence(lambda: calls.append(1))
    >>> fence.watch(opt); fence.watch(opt)   # idempotent
    >>> m(torch.ones(2)).sum().backward(); opt.step()
    >>> calls
    [1]
    >>> fence.remove()
    """

    def __init__(self, wait: Callable[[], None]) -> None:
        self._wait = wait
        self._handles: dict[int, Any] = {}

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        known = self._handles.get(id(optimizer))
        if known is not None and known[0]() is optimizer:
            return  # (an id can be reused once its optimizer is gone: compare the object)
        self._handles[id(optimizer)] = (weakref.ref(optimizer), optimizer.register_step_pre_hook(self._hook))

    def _hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._wait()

    def remove(self) -> None:
        for _, handle in self._handles.values():
            handle.remove()
        self._handles.clear()
