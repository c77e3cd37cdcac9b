"""Build a storable state from live training objects, and take it apart again.

``state_of`` is what ``dstt.save`` and ``dstt.Capture`` store; ``restore``
inverts it. Optimizer state is keyed by parameter *name*
(``optim/<param name>/<key>``), not by the integer ids of
``optimizer.state_dict()``, so diffs across runs and restores into a freshly
built optimizer both work.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from dstt.errors import ConfigError, InvalidNameError, RestoreMismatchError
from dstt.format import args as A

PARAM_GROUPS = "param_groups"


def _param_names(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> list[str]:
    """Names of the optimizer's parameters in state_dict index order."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if model is not None:
        by_id: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), name)
        missing = [i for i, p in enumerate(params) if id(p) not in by_id]
        if missing:
            raise InvalidNameError(
                f"{len(missing)} optimizer parameter(s) do not belong to the model "
                f"(first at index {missing[0]}); pass the model that owns them"
            )
        return [by_id[id(p)] for p in params]
    names = [n for g in optimizer.param_groups for n in g.get("param_names", [])]
    if len(names) != len(params):
        raise InvalidNameError(
            "optimizer state is keyed by parameter name: pass model= too, or build the "
            "optimizer from model.named_parameters()"
        )
    return names


def optimizer_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None) -> dict[str, Any]:
    """``optimizer.state_dict()`` re-keyed by parameter name.

    >>> m = torch.nn.Linear(2, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)
    >>> sorted(optimizer_state(opt, m))
    ['bias', 'param_groups', 'weight']
    """
    names = _param_names(optimizer, model)
    if PARAM_GROUPS in names:
        raise InvalidNameError(f"a parameter named {PARAM_GROUPS!r} collides with the optimizer's groups")
    if len(set(names)) != len(names):
        raise InvalidNameError("two optimizer parameters share a name")
    sd = optimizer.state_dict()
    # (C-level passes: this runs per parameter on every snapshot(), issue 25;
    # each state a copy, as state_dict() hands out the optimizer's own dicts)
    states = sd["state"]
    out: dict[str, Any] = dict(zip(map(names.__getitem__, states), map(dict, states.values())))
    if len(out) < len(names):
        for name in names:
            out.setdefault(name, {})
    groups = []
    for g in sd["param_groups"]:
        g = dict(g)
        g["params"] = [names[i] for i in g["params"]]
        groups.append(g)
    out[PARAM_GROUPS] = groups
    return out


def optimizer_state_dict_from(
    saved: dict[str, Any], optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None
) -> dict[str, Any]:
    """Invert :func:`optimizer_state` for a (possibly freshly built) optimizer."""
    names = _param_names(optimizer, model)
    groups = saved.get(PARAM_GROUPS)
    if not isinstance(groups, list):
        raise RestoreMismatchError("stored optimizer state has no param_groups")
    if len(groups) != len(optimizer.param_groups):
        raise RestoreMismatchError(
            f"stored optimizer has {len(groups)} param groups, live one has {len(optimizer.param_groups)}"
        )
    index = {n: i for i, n in enumerate(names)}
    stored_names = [n for g in groups for n in g["params"]]
    missing = sorted(set(names) - set(stored_names))
    unexpected = sorted(set(stored_names) - set(names))
    if missing or unexpected:
        raise RestoreMismatchError(
            f"optimizer parameters differ: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    state = {index[n]: dict(v) for n, v in saved.items() if n != PARAM_GROUPS and v}
    out_groups = []
    for g in groups:
        g = dict(g)
        g["params"] = [index[n] for n in g["params"]]
        out_groups.append(g)
    return {"state": state, "param_groups": out_groups}


def indexed_optimizer_state(saved: dict[str, Any]) -> dict[str, Any]:
    """A stored (name-keyed) optimizer state in ``optimizer.state_dict()``'s
    own form, without a live optimizer: the parameter order is the one
    recorded at capture (each group's ``params``, names in state_dict index
    order: :func:`optimizer_state`). What ``.pt`` exports hold, so
    ``optimizer.load_state_dict`` takes them.

    >>> m = torch.nn.Linear(2, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    >>> m(torch.ones(1, 2)).sum().backward(); opt.step()
    >>> back = indexed_optimizer_state(optimizer_state(opt, m))
    >>> back["param_groups"][0]["params"], sorted(back["state"])
    ([0, 1], [0, 1])
    """
    groups = saved.get(PARAM_GROUPS)
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               for g in groups):
        raise RestoreMismatchError("stored optimizer state has no param_groups with params")
    names = [n for g in groups for n in g["params"]]
    index = {n: i for i, n in enumerate(names)}
    state = {index[n]: dict(v) for n, v in saved.items() if n != PARAM_GROUPS and v and n in index}
    out_groups = [{**g, "params": [index[n] for n in g["params"]]} for g in groups]
    return {"state": dict(sorted(state.items())), "param_groups": out_groups}


def rng_state() -> dict[str, Any]:
    """RNG states of torch (CPU and CUDA), numpy and Python ``random``."""
    out: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(saved: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    if "torch" in saved:
        torch.set_rng_state(torch.as_tensor(saved["torch"], dtype=torch.uint8))
    if "numpy" in saved:
        np.random.set_state(tuple(saved["numpy"]))
    if "python" in saved:
        st = saved["python"]
        random.setstate((st[0], tuple(st[1]), st[2]))
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.as_tensor(s, dtype=torch.uint8) for s in saved["cuda"]])


def _rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_objects(model: Any = None, optimizer: Any = None, scheduler: Any = None, *, restoring: bool = False) -> None:
    """ConfigError unless each live object given is what :func:`state_of`
    reads (and, ``restoring``, what a restore writes): ``model`` an
    ``nn.Module``, ``optimizer`` an optimizer (``param_groups``, ``state``),
    ``scheduler`` something with ``state_dict`` (and ``load_state_dict``).

    >>> check_objects(model=torch.nn.Linear(1, 1))
    >>> check_objects(optimizer="adam")
    Traceback (most recent call last):
    dstt.errors.ConfigError: optimizer must be a torch optimizer (with param_groups and state), got str
    """
    if model is not None and not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    needed: tuple[str, ...] = ("param_groups", "state", "load_state_dict") if restoring else ("param_groups", "state")
    if optimizer is not None and not all(hasattr(optimizer, a) for a in needed):
        raise ConfigError(f"optimizer must be a torch optimizer (with param_groups and state), "
                          f"got {type(optimizer).__name__}")
    need = ("state_dict", "load_state_dict") if restoring else ("state_dict",)
    if scheduler is not None and not all(callable(getattr(scheduler, a, None)) for a in need):
        raise ConfigError(f"scheduler must have {' and '.join(need)}, got {type(scheduler).__name__}")


def state_of(
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    rng: bool = True,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The storable state of a training loop.

    Keys: ``model`` (state_dict), ``optim`` (by parameter name, with
    ``param_groups``), ``scheduler`` (state_dict), ``rng`` (per rank under
    torch.distributed: ``rng/rank<r>/...``), ``extra`` (user values).
    RNG states are included unless ``rng=False``, as ``Capture.snapshot``
    and ``dstt.restore`` default.

    >>> m = torch.nn.Linear(2, 1)
    >>> sorted(state_of(model=m, extra={"epoch": 3}))
    ['extra', 'model', 'rng']
    >>> sorted(state_of(model=m, rng=False))
    ['model']
    """
    check_objects(model, optimizer, scheduler)
    A.flag("rng", rng)
    state: dict[str, Any] = {}
    if model is not None:
        state["model"] = model.state_dict()
    if optimizer is not None:
        state["optim"] = optimizer_state(optimizer, model)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if rng:
        rank, world = _rank()
        state["rng"] = {f"rank{rank}": rng_state()} if world > 1 else rng_state()
    if extra is not None:
        if not isinstance(extra, dict):
            raise InvalidNameError(f"extra must be a dict, got {type(extra).__name__}")
        state["extra"] = extra
    return state
