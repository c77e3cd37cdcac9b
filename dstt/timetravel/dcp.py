"""torch.distributed.checkpoint (DCP) in and out.

* :func:`export_dcp` writes a step as a DCP checkpoint directory laid out as
  ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives it:
  ``model`` (the model's state_dict), ``optimizer`` (``state`` and
  ``param_groups`` keyed by parameter name, the form
  ``set_optimizer_state_dict`` takes), ``lr_scheduler``, and the step's
  other subtrees as they are (``extra``, ``rng``, ...). A trainer that loads
  with ``dcp.load({"model": ..., "optimizer": ...}, checkpoint_id=DIR)``
  and ``set_state_dict`` continues from it.
* :func:`import_dcp` reads a DCP checkpoint (or a directory of step
  checkpoints) whole, without knowing its layout, and saves each as a dstt
  step: the inverse mapping (``optimizer`` in get_state_dict form becomes
  dstt's ``optim``, ``lr_scheduler`` becomes ``scheduler``), every other
  key as it is.

Single process (``no_dist``): a checkpoint saved by N ranks is read whole;
written, it is one rank's file set that any world size can load (DCP
reshards on load).
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable

from dstt.errors import ConfigError, InvalidReferenceError
from dstt.format.flatexport import ExportInfo, subtree
from dstt.format.refs import Ref
from dstt.store.reader import TensorReader as Run
from dstt.store.state import PARAM_GROUPS
from dstt.store.tree import unflatten

#: dstt top-level key <-> the key get_state_dict-style trainers use.
RENAMES = {"optim": "optimizer", "scheduler": "lr_scheduler"}
METADATA_FILE = ".metadata"


def _dcp_optimizer(optim: Any) -> Any:
    """dstt's name-keyed optimizer state -> get_optimizer_state_dict's form."""
    if not (isinstance(optim, dict) and isinstance(optim.get(PARAM_GROUPS), list)):
        return optim
    state = {n: v for n, v in optim.items() if n != PARAM_GROUPS and v}
    return {"state": state, "param_groups": optim[PARAM_GROUPS]}


def _dstt_optimizer(opt: Any) -> Any:
    """get_optimizer_state_dict's form -> dstt's name-keyed optimizer state
    (other forms, e.g. integer ids, are kept as they are)."""
    if not (isinstance(opt, dict) and set(opt) == {"state", "param_groups"}
            and isinstance(opt["param_groups"], list) and isinstance(opt["state"], dict)):
        return None
    names = [n for g in opt["param_groups"] if isinstance(g, dict) for n in g.get("params", [])]
    if not names or not all(isinstance(n, str) for n in names) or PARAM_GROUPS in names:
        return None
    out: dict[str, Any] = {n: dict(opt["state"].get(n, {})) for n in names}
    out[PARAM_GROUPS] = [dict(g) for g in opt["param_groups"]]
    return out


def export_dcp(ref: Any, out: str | os.PathLike[str], only: str | None = None, *,
               progress: Callable[[int, int], None] | None = None) -> ExportInfo:
    """Write step ``ref`` (``STORE[@BRANCH][:STEP]``) as a DCP checkpoint
    directory ``out`` (new or empty; see the module docstring)."""
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from dstt.timetravel.export import _read_tensors, _weights_only_safe

    out = os.fspath(out)
    if os.path.lexists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        raise ConfigError(f"{out!r} exists; a DCP checkpoint is written to a new or empty directory")
    run = ref if isinstance(ref, Run) else Run(os.fspath(ref))
    rec = run.record()
    tree = subtree(rec, only)
    names: list[str] = []
    unflatten(tree, lambda n, k: names.append(n))
    tensors = _read_tensors(run, rec, names, progress, 4)
    info = ExportInfo(out, "dcp", rec.branch, rec.step, len(names),
                      sum(t.numel() * t.element_size() for t in tensors.values()))
    state = unflatten(tree, lambda n, k: tensors[n])
    if not only and isinstance(state, dict):
        state = {RENAMES.get(k, k): (_dcp_optimizer(v) if k == "optim" else v) for k, v in state.items()}
    elif (only or "").strip("/") == "optim":
        state = _dcp_optimizer(state)
    state = _weights_only_safe(state, info.notes, only or "")
    if not isinstance(state, dict):
        state = {only or "value": state}
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # ("torch.distributed is disabled ...": one process)
            dcp_save(state, checkpoint_id=tmp, no_dist=True)
        if os.path.isdir(out):
            os.rmdir(out)
        os.replace(tmp, out)
    finally:
        if os.path.isdir(tmp):
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return info


def load_dcp(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The whole state of a DCP checkpoint directory, as it was saved."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        # (what torch.distributed.checkpoint.format_utils.dcp_to_torch_save does, without the file)
        _load_state_dict(state, storage_reader=FileSystemReader(os.fspath(path)),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)  # type: ignore[no-untyped-call]
    return state


def dstt_state(state: dict[str, Any]) -> dict[str, Any]:
    """A loaded DCP state as dstt stores it (the inverse of export's mapping)."""
    out: dict[str, Any] = {}
    back = {v: k for k, v in RENAMES.items()}
    for k, v in state.items():
        if k == "optimizer":
            opt = _dstt_optimizer(v)
            if opt is not None:
                out["optim"] = opt
                continue
        key = back.get(k, k)
        out[k if key != k and key in state else key] = v  # (never over a key the checkpoint has itself)
    return out


_STEP_RE = re.compile(r"(\d+)$")


def checkpoints(path: str | os.PathLike[str]) -> list[tuple[int | None, Path]]:
    """(step from the name, directory) of the DCP checkpoint ``path`` or of
    each checkpoint directly inside it (``step-100``, ``step_200``, ``300``),
    in step order."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"{os.fspath(path)!r} is not a directory")
    if (p / METADATA_FILE).is_file():
        m = _STEP_RE.search(p.name)
        return [(int(m.group(1)) if m else None, p)]
    found: list[tuple[int | None, Path]] = []
    for d in sorted(p.iterdir()):
        if d.is_dir() and (d / METADATA_FILE).is_file():
            m = _STEP_RE.search(d.name)
            if m is None:
                raise ConfigError(f"cannot tell the step of checkpoint {d.name!r} (its name ends in no number)")
            found.append((int(m.group(1)), d))
    if not found:
        raise ConfigError(f"{os.fspath(path)!r} holds no DCP checkpoint (no {METADATA_FILE} in it or in its "
                          "subdirectories)")
    return sorted(found, key=lambda x: x[0] or 0)


def import_dcp(path: str | os.PathLike[str], target: str, *,
               progress: Callable[[int, int], None] | None = None) -> list[tuple[str, int, int]]:
    """Save the DCP checkpoint(s) at ``path`` into the store ``target``
    (``STORE[@BRANCH][:STEP]``: the step is needed only when the checkpoint's
    directory name ends in no number); ``[(branch, step, n_tensors)]``."""
    from dstt.format.writeoptions import WriteOptions
    from dstt.store.writer import Writer

    ref = Ref.parse(target)
    found = checkpoints(path)
    if ref.step is not None and len(found) > 1:
        raise InvalidReferenceError(f"{target!r} names a step, but {os.fspath(path)!r} holds "
                                    f"{len(found)} checkpoints (each takes the step its name ends in)")
    branch = ref.branch or "main"
    done = []
    for i, (step, d) in enumerate(found):
        if ref.step is not None:
            if not isinstance(ref.step, int):
                raise InvalidReferenceError(f"import-dcp needs a step number, got {ref.step!r}")
            step = ref.step
        if step is None:
            raise ConfigError(f"cannot tell the step of {os.fspath(d)!r}: give it as STORE:STEP")
        state = dstt_state(load_dcp(d))
        with Writer(ref.store, WriteOptions(branch=branch)) as w:  # (what dstt.save does)
            info = w.write(step, state)
        done.append((branch, step, info.n_tensors))
        if progress is not None:
            progress(i + 1, len(found))
    return done


__all__ = ["export_dcp", "import_dcp", "load_dcp", "checkpoints"]
