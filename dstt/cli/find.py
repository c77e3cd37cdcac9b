"""``dstt find``: the first step where something went wrong (NaN/Inf, a
norm or value jump, a loss spike, a jump of the update ratio, a stat
threshold; in the default scope of :mod:`dstt.analysis.scope`) on every branch or
one, beside the incidents the capture recorded; or, with ``--diverge``,
the first step where two branches differ. From the step index (torch-free).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional

import typer

from dstt.cli.output import JSON_OPT, emit_json, handle_errors, stderr
from dstt.cli.targets import open_index

if TYPE_CHECKING:
    from dstt.format.index import RunIndex


def cmd_find(target: str, tensors: list[str], branch: Optional[str], nonfinite: Optional[bool],
             jump: Optional[float], stat: Optional[str], gt: Optional[float], lt: Optional[float],
             all_steps: bool, json_out: bool, diverge: list[str] | None = None,
             update_jump: Optional[float] = None, spike: Optional[float] = None, values: bool = True) -> None:
    """Detections (or ``--diverge``'s first difference) in STORE[@BRANCH]."""
    from dstt.errors import InvalidReferenceError

    run, ref = open_index(target)
    if ref.step is not None:
        raise InvalidReferenceError(f"find takes STORE[@BRANCH], not a step: got {target!r}")
    if diverge:
        _diverge(run, diverge, branch or ref.branch or "main", json_out)
        return
    if (nonfinite is None and jump is None and stat is None and gt is None and lt is None and update_jump is None
            and spike is None):
        from dstt.analysis.anomaly import SPIKE

        nonfinite, jump, update_jump, spike = True, 10.0, 10.0, SPIKE
    checks: dict[str, Any] = {"nonfinite": bool(nonfinite), "jump": jump, "stat": stat, "gt": gt, "lt": lt,
                              "update_jump": update_jump, "spike": spike, "values": values}
    if branch is None and ref.branch is None:  # every branch, unless told otherwise
        _find_everywhere(run, tensors, not all_steps, checks, json_out)
    else:
        _find_on(run, tensors, branch or run.default_branch, not all_steps, checks, json_out)


def _diverge(run: RunIndex, diverge: list[str], base: str, json_out: bool) -> None:
    """``--diverge B`` (B against ``base``) or ``--diverge A --diverge B``."""
    from dstt.analysis.branches import first_divergence
    from dstt.cli.output import stdout

    if len(diverge) > 2:
        from dstt.errors import ConfigError

        raise ConfigError("--diverge takes one branch (compared with --branch or main) or two")
    a, b = (diverge[0], diverge[1]) if len(diverge) == 2 else (base, diverge[0])
    d = first_divergence(run, a, b)
    if json_out:
        emit_json(d)
        return
    fork = f"share steps up to {d['fork'][0]}:{d['fork'][1]}" if d["fork"] else "share no step"
    where = (f"first differ at step {d['step']} ({len(d['tensors'])} tensors: "
             f"{', '.join(d['tensors'][:5])}{', ...' if len(d['tensors']) > 5 else ''})"
             if d["step"] is not None else "never differ on the steps both captured")
    stdout.print(f"{a} and {b} {fork}; they {where}")


def _find_everywhere(run: RunIndex, tensors: list[str], first: bool, checks: dict[str, Any],
                     json_out: bool) -> None:
    """Every branch, each judged on its own trajectory."""
    from dstt.analysis.anomaly import group_by_step
    from dstt.analysis.branches import find_branches
    from dstt.cli import render

    per = find_branches(run, tensors, first=first, **checks)
    events = sorted((e for evs in per.values() for e in evs), key=lambda e: (e["step"], e["branch"]))
    firsts = {b: (evs[0]["step"] if evs else None) for b, evs in per.items()}
    incidents = incident_rows(run, None)
    held = held_rows(run, list(per))
    if json_out:
        emit_json({"branch": None, "branches": firsts, "first_step": events[0]["step"] if events else None,
                   "detections": _plain_groups(group_by_step(events)), "events": events, "incidents": incidents,
                   "held": held})
    else:
        render.events(f"on any of {len(per)} branch(es)", events)
        _render_incidents(incidents)
        _render_held(held)


def _find_on(run: RunIndex, tensors: list[str], branch: str, first: bool, checks: dict[str, Any],
             json_out: bool) -> None:
    """One branch (its parents' steps up to the fork count as history)."""
    from dstt.analysis.anomaly import find, group_by_step
    from dstt.cli import render

    events = find(run, tensors, branch, first=first, **checks)
    incidents = incident_rows(run, branch)
    held = held_rows(run, [branch])
    if json_out:
        emit_json({"branch": branch, "first_step": events[0]["step"] if events else None,
                   "detections": _plain_groups(group_by_step(events)), "events": events, "incidents": incidents,
                   "held": held})
    else:
        render.events(f"on branch {branch!r}", events)
        _render_incidents(incidents)
        _render_held(held)


def _plain_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Detections for JSON: one per step, without the events repeated."""
    return [{k: v for k, v in g.items() if k != "events"} for g in groups]


def incident_rows(run: RunIndex, branch: Optional[str]) -> list[dict[str, Any]]:
    """Recorded incidents (of ``branch``, or every branch) as plain data."""
    from dstt.format.incidents import list_incidents

    return [i.to_dict() for i in list_incidents(run.backend, branch)]


def held_rows(run: RunIndex, branches: list[str]) -> dict[str, dict[str, Any]]:
    """Per branch, the steps a live capture's memory tier holds now and by
    how many ranks: the listing's ``held`` entries (dstt.analysis.listing)."""
    from dstt.analysis.listing import held_in_memory

    return {b: held_in_memory(run.backend, b) for b in branches}


def _render_held(held: dict[str, dict[str, Any]]) -> None:
    """One line per branch whose tier holds steps now (as ``dstt ls``)."""
    from dstt.analysis.listing import held_text
    from dstt.cli.output import stdout

    for b, h in held.items():
        text = held_text(h)
        if text:
            stdout.print(f"branch {b!r}: held in memory now: {text}")


def _render_incidents(incidents: list[dict[str, Any]]) -> None:
    from dstt.cli import render

    if incidents:
        render.incidents_table(f"{len(incidents)} recorded incident(s)", incidents)
    else:
        stderr.print("no incidents recorded")


def register(app: typer.Typer) -> None:
    @app.command("find")
    @handle_errors
    def find(
        target: str = typer.Argument(..., metavar="STORE", help="STORE[@BRANCH]."),
        tensors: Optional[List[str]] = typer.Argument(None, metavar="[TENSOR_GLOB]...", help="Only these tensors."),
        branch: Optional[str] = typer.Option(None, "--branch", "-b", help="Only this branch (default: the reference's, else every branch)."),
        nonfinite: Optional[bool] = typer.Option(None, "--nonfinite/--no-nonfinite", help="Look for NaN/Inf values."),
        jump: Optional[float] = typer.Option(None, "--jump", help="Look for a norm change of more than this factor between captured steps."),
        update_jump: Optional[float] = typer.Option(None, "--update-jump", help="Look for an update ratio (|θ_k - θ_k-1| / |θ_k|) above this factor times the median of the tensor's previous 8."),
        spike: Optional[float] = typer.Option(None, "--spike", help="Look for a loss, norm or other rising-only value above this factor times its high of the previous 32 steps, more for a noisy value (default 1.5)."),
        values: bool = typer.Option(True, "--values/--no-values", help="Also look at values (extra/loss, learning rates, scheduler state)."),
        stat: Optional[str] = typer.Option(None, "--stat", help="Stat for --gt/--lt (default norm)."),
        gt: Optional[float] = typer.Option(None, "--gt", help="Look for the stat above this value."),
        lt: Optional[float] = typer.Option(None, "--lt", help="Look for the stat below this value."),
        all_steps: bool = typer.Option(False, "--all", help="Every matching step, not only the first."),
        diverge: Optional[List[str]] = typer.Option(None, "--diverge", metavar="BRANCH", help="Instead: the first step where BRANCH differs from --branch (or main); give it twice to compare two branches."),
        json_out: bool = JSON_OPT,
    ) -> None:
        """Find the first step where something went wrong, or where two branches first differ.

        Default: NaN/Inf, a 10x norm or value jump (k x 10 across a gap of k usual step spacings), a 10x jump of the update ratio, a loss (or other rising-only value) above 1.5x its recent high (more for a noisy one), on every branch unless STORE@BRANCH or --branch names one. Looks at model tensors and float values (extra/loss, learning rates, scheduler state), never at RNG states, optimizer state, step counters or data offsets, unless TENSOR_GLOB names them. Incidents the capture recorded are listed beside the detections.

        --diverge A --diverge B: where two branches first differ."""
        cmd_find(target, tensors or [], branch, nonfinite, jump, stat, gt, lt, all_steps, json_out, diverge or [],
                 update_jump=update_jump, spike=spike, values=values)
