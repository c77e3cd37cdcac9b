"""``dstt verify``: check every committed step -- manifests, chunk
CRC-32C, sha256 per chunk and per tensor (:func:`dstt.format.verify.verify`);
exit code 1 when anything is corrupt or missing. Torch-free."""

from __future__ import annotations

from typing import Any, Optional

import typer

from dstt.cli.output import emit_json, handle_errors, stderr, stdout
from dstt.cli.scanopts import EXECUTOR_OPT, WORKERS_OPT, scan_args


def cmd_verify(ref: str, json_out: bool, quiet: bool, scan: Optional[dict[str, Any]] = None) -> None:
    """Verify ``ref`` and print the problems and the verdict; exit 1 unless it is OK."""
    from dstt.cli.render import progress
    from dstt.format.verify import verify as run_verify

    with progress("verifying", enabled=not quiet, unit="items") as update:
        report = run_verify(ref, progress=lambda done, total, what: update(done, total, f"verifying {what}"),
                            **(scan or {}))
    if json_out:
        emit_json(report.to_dict())
    else:
        for p in report.problems:
            stdout.print(f"CORRUPT {p}")
        if report.partial:
            stderr.print(f"{len(report.partial)} uncommitted step(s) left by an interrupted writer "
                         f"(invisible to readers; dstt gc removes them): {', '.join(report.partial[:5])}")
        orphans = report.orphans or {}
        if orphans.get("chunks") or orphans.get("arrays"):
            stderr.print(f"{orphans['chunks']} chunk(s) in {orphans['arrays']} array(s) no committed step "
                         f"references ({orphans['bytes']} bytes; left by interrupted writers or prune; "
                         "no step reads them; dstt gc removes them)")
        verdict = "OK" if report.ok else f"{len(report.problems)} problem(s)"
        stdout.print(f"{verdict}: {report.steps} steps, {report.tensors} tensors, "
                     f"{report.chunks} chunks ({report.bytes} bytes) checked in {report.store}")
    if not report.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    @app.command()
    @handle_errors
    def verify(
        ref: str = typer.Argument(..., help="STORE[@BRANCH][:STEP]; without a branch, every branch."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable report on stdout."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
        workers: Optional[int] = WORKERS_OPT,
        executor: Optional[str] = EXECUTOR_OPT,
    ) -> None:
        """Check every committed step: manifests, chunk CRC-32C, sha256 per chunk and per tensor.

        Exits 1 when anything is corrupt or missing, naming the step and tensor.
        """
        cmd_verify(ref, json_out, quiet, scan_args(workers, executor))
