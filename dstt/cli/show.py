"""``dstt show``: one tensor's stats, a value histogram and some of its
values; or a value (``optim/param_groups/0/lr``, ``extra/loss``) and its
subtree (:mod:`dstt.cli.values`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import typer

from dstt.cli.output import JSON_OPT, emit_json, handle_errors
from dstt.cli.targets import open_tensors

if TYPE_CHECKING:
    import torch


def cmd_show(target: str, tensor: str, slice_text: Optional[str], bins: int, json_out: bool) -> None:
    """Show a tensor (reads its values: imports torch) or a value path (torch-free)."""
    from dstt.analysis.history import histogram
    from dstt.analysis.select import parse_slice
    from dstt.cli import render
    from dstt.cli.values import show_value

    if show_value(target, tensor, json_out):  # a value path: optim/param_groups/0/lr, extra/loss, ...
        return
    run = open_tensors(target)
    branch, step = run.resolve()
    e = run.entry(tensor, step, branch=branch)
    index: Any = parse_slice(slice_text) if slice_text else preview_index(e.shape)
    values = run.read(tensor, step, branch=branch, index=index)
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


def to_list(t: torch.Tensor) -> Any:
    """A tensor's values as JSON-ready lists: complex as ``[re, im]`` pairs,
    low-precision floats widened, unsigned integers as int64 (uint64 as
    float64)."""
    import torch

    if t.is_complex():
        return [[float(z.real), float(z.imag)] for z in t.reshape(-1).tolist()] if t.dim() else [t.real.item(), t.imag.item()]
    if t.dtype not in (torch.float64, torch.float32, torch.bool) and t.is_floating_point():
        t = t.to(torch.float64)
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):
        t = t.to(torch.int64) if t.dtype != torch.uint64 else t.to(torch.float64)
    return t.tolist()


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
