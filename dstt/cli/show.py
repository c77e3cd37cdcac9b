"""``dstt show``: one tensor's stats, a value histogram and some of its
values; or a value (``optim/param_groups/0/lr``, ``extra/loss``) and its
subtree (:mod:`dstt.cli.values`). Torch-free: tensors are read as numpy
arrays (bfloat16 and float8 widened exactly, :func:`dstt.format.dtypes.decode`)."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import typer

from dstt.cli.output import JSON_OPT, emit_json, handle_errors
from dstt.cli.targets import open_index


def cmd_show(target: str, tensor: str, slice_text: Optional[str], bins: int, json_out: bool) -> None:
    """Show a tensor or a value path."""
    from dstt.analysis.history import histogram
    from dstt.analysis.select import parse_slice
    from dstt.cli import render
    from dstt.cli.values import show_value
    from dstt.format.dtypes import decode

    if show_value(target, tensor, json_out):  # a value path: optim/param_groups/0/lr, extra/loss, ...
        return
    run, _ = open_index(target)
    branch, step = run.resolve()
    e = run.entry(tensor, step, branch=branch)
    index: Any = parse_slice(slice_text) if slice_text else preview_index(e.shape)
    values = decode(run.read_array(tensor, step, branch=branch, index=index), e.dtype)
    hist = histogram(run, tensor, step, branch, bins)
    data = {"store": run.url, "branch": branch, "step": step, "name": tensor, "shape": list(e.shape),
            "dtype": e.dtype.logical, "nbytes": e.nbytes, "written": e.written, "stats": dict(e.stats),
            "histogram": hist, "slice": slice_text or index_text(index),
            "values": to_list(values)}
    if json_out:
        emit_json(data)
    else:
        render.show(data, values)


def preview_index(shape: tuple[int, ...]) -> tuple[Any, ...]:
    """The first few values: leading rows and columns.

    >>> preview_index((100,)), preview_index(())
    ((slice(0, 8, None),), ())
    >>> preview_index((5, 6, 7))
    (slice(0, 4, None), 0, slice(0, 8, None))
    """
    if not shape:
        return ()
    if len(shape) == 1:
        return (slice(0, 8),)
    return (slice(0, 4),) + (0,) * (len(shape) - 2) + (slice(0, 8),)


def index_text(index: tuple[Any, ...]) -> str:
    """An index as ``--slice`` writes it.

    >>> index_text((slice(0, 4), 0, slice(None, 8), Ellipsis))
    '0:4,0,:8,...'
    """
    def one(x: Any) -> str:
        if isinstance(x, slice):
            return f"{'' if x.start is None else x.start}:{'' if x.stop is None else x.stop}"
        return "..." if x is Ellipsis else str(x)

    return ",".join(one(x) for x in index)


def to_list(a: np.ndarray) -> Any:
    """An array's values as JSON-ready lists: complex as ``[re, im]`` pairs,
    floats as float64, unsigned integers as int64 (uint64 as float64).

    >>> to_list(np.array([1 + 2j])), to_list(np.array(3, dtype=np.uint64)), to_list(np.float32([0.5]))
    ([[1.0, 2.0]], 3.0, [0.5])
    """
    a = np.asarray(a)
    if np.iscomplexobj(a):
        if a.ndim == 0:
            return [float(a.real), float(a.imag)]
        return [[float(z.real), float(z.imag)] for z in a.reshape(-1).tolist()]
    if a.dtype.kind == "f":
        a = a.astype(np.float64)
    elif a.dtype == np.uint64:
        a = a.astype(np.float64)
    elif a.dtype.kind == "u":
        a = a.astype(np.int64)
    return a.tolist()


def register(app: typer.Typer) -> None:
    @app.command("show")
    @handle_errors
    def show(
        target: str = typer.Argument(..., metavar="REF", help="STORE[@BRANCH][:STEP] (default step: latest)."),
        tensor: str = typer.Argument(..., help="Tensor name, e.g. model/layers.0.weight."),
        slice_text: Optional[str] = typer.Option(None, "--slice", help="Values to print, NumPy style: '0:4,:'."),
        bins: int = typer.Option(20, min=1, max=200, help="Histogram bins."),
        json_out: bool = JSON_OPT,
    ) -> None:
        """Stats, a value histogram and some values of one tensor."""
        cmd_show(target, tensor, slice_text, bins, json_out)
