"""``dstt import-dcp DIR STORE[@BRANCH][:STEP]``: bring a
torch.distributed.checkpoint directory (or a directory of step
checkpoints) into a dstt store, so ``ls``/``diff``/``history``/``find``
work on runs that never used dstt (:func:`dstt.timetravel.dcp.import_dcp`)."""

from __future__ import annotations

import typer

from dstt.cli.output import emit_json, handle_errors, stdout


def cmd_import(src: str, target: str, json_out: bool) -> None:
    """Import ``src`` into ``target``; checks before torch is imported."""
    import os

    from dstt.errors import ConfigError
    from dstt.format.refs import Ref

    Ref.parse(target)  # a malformed reference: refused before anything is read
    if not os.path.isdir(src):
        raise ConfigError(f"{src!r} is not a directory (a DCP checkpoint is one)")
    from dstt.timetravel.dcp import import_dcp

    done = import_dcp(src, target)
    if json_out:
        emit_json({"imported": [{"branch": b, "step": s, "n_tensors": n} for b, s, n in done]})
        return
    for b, s, n in done:
        stdout.print(f"imported step {s} of branch {b!r}: {n} tensors")


def register(app: typer.Typer) -> None:
    @app.command("import-dcp")
    @handle_errors
    def import_dcp(
        src: str = typer.Argument(..., metavar="DIR", help="A DCP checkpoint directory, or a directory of them (step-100/, step-200/, ...)."),
        target: str = typer.Argument(..., metavar="STORE[@BRANCH][:STEP]", help="Store to save into; STEP when DIR's name ends in no number."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable report on stdout."),
    ) -> None:
        """Import a torch.distributed.checkpoint (DCP) checkpoint into a store."""
        cmd_import(src, target, json_out)
