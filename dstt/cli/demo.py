"""``dstt demo``: the embedded default job -- train a small model on CPU,
capture every step into a local store, then show what was captured (``ls``
of the store and a diff of its first and last steps)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import typer

from dstt.cli.output import emit_json, handle_errors, stderr


def run_demo(store: Path, steps: int, seed: int) -> dict[str, Any]:
    """Train a tiny MLP for ``steps`` iterations, capturing every step with :class:`dstt.Capture`."""
    import torch

    import dstt

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    x = torch.randn(256, 16)
    y = x[:, :4].sin()
    losses = []
    with dstt.Capture(store) as cap:  # lazy: copies and writes overlap the next iteration
        for step in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            cap.snapshot(step, model=model, optimizer=opt, scheduler=sched, rng=True,
                         extra={"loss": losses[-1], "step": step})
    return {"store": str(store), "steps": steps, "final_loss": losses[-1]}


def prepare_store(store: Path, overwrite: bool) -> None:
    """Refuse to train into an existing path unless it is a dstt store and
    ``overwrite`` was asked for (then it is removed first)."""
    from dstt.errors import StoreExistsError
    from dstt.format.backends import open_backend
    from dstt.format.root import check_root

    if not store.exists():
        return
    if not overwrite:
        raise StoreExistsError(f"{store} already exists; pass --overwrite to replace the demo store, "
                               "or give another path")
    check_root(open_backend(str(store), create=False))  # never remove something that is not a dstt store
    stderr.print(f"removing the earlier demo store {store}")
    shutil.rmtree(store)


def register(app: typer.Typer) -> None:
    @app.command()
    @handle_errors
    def demo(
        store: Path = typer.Argument(Path("dstt-demo"), help="Where to create the demo store."),
        steps: int = typer.Option(20, min=2, help="Training iterations to run and capture."),
        seed: int = typer.Option(0, help="Random seed."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing dstt store at STORE."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        """Train a small model on CPU capturing every step, then list the store and diff two steps."""
        from dstt.analysis.diff import diff_points, sort_rows
        from dstt.analysis.listing import list_store
        from dstt.analysis.select import resolve_point
        from dstt.cli import render
        from dstt.store.reader import TensorReader as Run

        prepare_store(store, overwrite)
        result = run_demo(store, steps, seed)
        run = Run(str(store))
        first, last = resolve_point(run, 0), resolve_point(run, "latest")
        all_rows = diff_points(first, last, [])
        from dstt.analysis.values import section_sorted

        rows = section_sorted(sort_rows(all_rows, "rel_change"))[:8]  # weights first, Adam's step counters last
        a, b = f"{run.url}@main:{first[2]}", f"{run.url}@main:{last[2]}"
        if json_out:
            emit_json({**result, "branches": list_store(run, None), "diff": {"a": a, "b": b, "tensors": rows}})
            return
        stderr.print(f"trained {steps} steps on CPU, final loss {result['final_loss']:.4f}; "
                     f"every step captured into {store}\n")
        render.store_listing(run.url, list_store(run, None), 8)
        render.diff_table(a, b, rows, all_rows)
        stderr.print("\nnext, try:\n" + _hints(store, steps // 2))


def _hints(store: Path, mid: int) -> str:
    """Commands worth trying on the demo store, their descriptions in one column."""
    plots = importlib.util.find_spec("matplotlib") is not None
    needs = "" if plots else " (pip install 'dstt[plot]')"
    hints = [
        (f"dstt ls {store}:latest", "tensors with their stats"),
        (f"dstt show {store}:{mid} model/0.weight", "one tensor: stats, histogram, values"),
        (f"dstt show {store}:{mid} optim/param_groups/0/lr", "a value: the learning rate"),
        (f"dstt history {store} 'model/*' --plot norms.png", "a stat across steps, as a plot" + needs),
        (f"dstt report {store} -o report.html", "the whole run on one page" + needs),
        (f"dstt export {store}:{mid} --out step{mid}.safetensors", "export a step to a file"),
        (f"python: dstt.restore('{store}:{mid}', model=..., optimizer=...)", "roll back and resume"),
    ]
    width = max(len(cmd) for cmd, _ in hints) + 3
    return "\n".join(f"  {cmd:<{width}}{what}" for cmd, what in hints)
