"""``dstt demo``: the embedded default job -- train a small model on CPU,
capture every step into a local store, then show what was captured."""

from __future__ import annotations

from pathlib import Path

import typer

from dstt.cli.output import emit_json, handle_errors, human_bytes, stderr, stdout


def run_demo(store: Path, steps: int, seed: int) -> dict:
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
            loss.backward()
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            cap.snapshot(step, model=model, optimizer=opt, scheduler=sched, rng=True,
                         extra={"loss": losses[-1], "step": step})
    return {"store": str(store), "steps": steps, "final_loss": losses[-1]}


def register(app: typer.Typer) -> None:
    @app.command()
    @handle_errors
    def demo(
        store: Path = typer.Argument(Path("dstt-demo"), help="Where to create the demo store."),
        steps: int = typer.Option(20, min=2, help="Training iterations to run and capture."),
        seed: int = typer.Option(0, help="Random seed."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        """Train a small model on CPU, capturing every step, then list the store."""
        import dstt

        result = run_demo(store, steps, seed)
        run = dstt.open(store)
        steps_list = run.steps()
        info = [run.commit_info(s) for s in steps_list]
        if json_out:
            emit_json({**result, "steps_captured": steps_list,
                       "bytes_written": sum(i["bytes_written"] for i in info)})
            return
        stderr.print(f"trained {steps} steps, final loss {result['final_loss']:.4f}")
        stdout.print(f"store {store}: {len(steps_list)} steps captured on branch main, "
                     f"{human_bytes(sum(i['bytes_written'] for i in info))} written, "
                     f"{human_bytes(sum(i['bytes_referenced'] for i in info))} referenced (unchanged)")
