"""The options every data-reading command shares: where its scan runs
(``--workers N``, ``--executor``; :mod:`dstt.format.scan`)."""

from __future__ import annotations

from typing import Any, Optional

import typer

WORKERS_OPT: Any = typer.Option(
    None, "--workers", "-j", min=1,
    help="Worker processes reading tensor data (default: one per core, DSTT_WORKERS; small scans run here).")
EXECUTOR_OPT: Any = typer.Option(
    None, "--executor",
    help="Where the scan runs: processes (default), threads, inline, or dask://HOST:PORT for a Dask cluster "
         "(also DSTT_EXECUTOR).")


def scan_args(workers: Optional[int], executor: Optional[str]) -> dict[str, Any]:
    """``executor=``/``workers=`` for the library call; a bad name is a one-line error before any work."""
    from dstt.format.scan import parse_executor

    out: dict[str, Any] = {}
    if executor is not None:
        out["executor"] = parse_executor(executor)
    if workers is not None:
        out["workers"] = workers
    return out


__all__ = ["WORKERS_OPT", "EXECUTOR_OPT", "scan_args"]
