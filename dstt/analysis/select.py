"""Shared helpers of the analysis functions: tensor-name globs and resolving
"the other side" of a comparison (a reference, a step, a (branch, step) pair).

>>> match_names(["model/w", "model/b", "optim/w/exp_avg"], ["model/*"])
['model/w', 'model/b']
"""

from __future__ import annotations

import fnmatch
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence, TypeVar

from dstt.errors import InvalidReferenceError, TensorNotFoundError

if TYPE_CHECKING:
    from dstt.format.index import RunIndex

#: A reader of a run: the step index alone (RunIndex) or with tensors (TensorReader).
R = TypeVar("R", bound="RunIndex")

# Chunks are read-only buffers that analysis only ever reads; torch's warning
# about wrapping non-writable arrays would be noise on stderr.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def is_glob(pattern: str) -> bool:
    """Is ``pattern`` a glob (``*``, ``?`` or ``[``) rather than a name?

    >>> is_glob("model/*"), is_glob("model/w")
    (True, False)
    """
    return any(c in pattern for c in "*?[")


def match_names(names: Sequence[str], patterns: Iterable[str] | None) -> list[str]:
    """Names matching any glob (``fnmatch``; ``*`` also crosses ``/``), in
    ``names`` order. No patterns: every name."""
    pats = [p for p in (patterns or []) if p]
    if not pats:
        return list(names)
    return [n for n in names if any(n == p or (is_glob(p) and fnmatch.fnmatchcase(n, p)) for p in pats)]


def require_matches(names: Sequence[str], patterns: Iterable[str] | None, where: str) -> list[str]:
    """Like :func:`match_names`, but a pattern matching nothing is an error
    (with a near-miss suggestion for plain names)."""
    from dstt.format.index import suggest

    out = match_names(names, patterns)
    for p in patterns or []:
        if p and not match_names(names, [p]):
            hint = "" if is_glob(p) else suggest(p, names)
            raise TensorNotFoundError(f"no tensor matches {p!r} {where}{hint}")
    return out


def resolve_point(run: R, spec: Any) -> tuple[R, str, int]:
    """Resolve one side of a comparison against ``run``: a point ``(run,
    branch, step)``, whose run is ``run`` or a reader of the same kind on
    another store.

    ``spec`` may be a step (``100``, ``"latest"``, ``"~2"``, ``None``) on the
    run's default branch, a ``(branch, step)`` pair, a reference string
    (``"runs/b@main:100"``; another store opens it), or a reference relative
    to this run's store (``":100"``, ``"@lr-sweep:~1"``).
    """
    from dstt.format.refs import Ref, split_in_store

    if isinstance(spec, tuple):
        if len(spec) != 2:
            raise InvalidReferenceError(f"expected a (branch, step) pair, got {spec!r}")
        branch, step = spec
        b, s = run.resolve(step, branch=branch)
        return run, b, s
    if spec is None or (isinstance(spec, int) and not isinstance(spec, bool)):
        b, s = run.resolve(spec, branch=None)
        return run, b, s
    if not isinstance(spec, str):
        raise InvalidReferenceError(f"cannot use {spec!r} as a reference: expected a step, (branch, step) or 'STORE[@BRANCH][:STEP]'")
    rel = split_in_store(spec)  # the one rule for references inside a known store (dstt.format.refs)
    if rel is not None:
        branch, step = rel  # ':STEP' keeps run's branch; '@BRANCH' means its latest
        b, s = run.resolve("latest" if step is None and branch else step, branch=branch)
        return run, b, s
    ref = Ref.parse(spec)  # a reference's omitted parts are main and latest, not run's
    other = open_other(run, ref.store)
    b, s = other.resolve("latest" if ref.step is None else ref.step, branch=ref.branch or "main")
    return other, b, s


def open_other(run: R, store: str) -> R:
    """``run`` itself when ``store`` names the same place, else a new Run."""
    import os

    here = run.url
    for cand in (store, os.path.abspath(store) if "://" not in store else store):
        if cand == here or cand.rstrip("/") == str(here).rstrip("/"):
            return run
    return type(run)(store)  # the same kind of reader (index only, or tensors too)


def step_filter(steps: Any) -> Callable[[int], bool]:
    """A test of step numbers from ``steps``: None (every step), a step, a
    list of steps, a ``range`` or a ``slice`` (``stop`` excluded; a slice's
    step keeps every k-th step number from ``start``, 0 by default).

    >>> [s for s in range(10) if step_filter(slice(2, 9, 3))(s)]
    [2, 5, 8]
    """
    from dstt.errors import ConfigError

    if steps is None:
        return lambda s: True
    if isinstance(steps, range):
        return steps.__contains__
    if isinstance(steps, slice):
        lo, hi, k = steps.start, steps.stop, steps.step
        if k is not None and (not isinstance(k, int) or k < 1):
            raise ConfigError(f"a slice of steps needs a positive step, got {k!r}")
        return lambda s: ((lo is None or s >= lo) and (hi is None or s < hi)
                          and (k is None or (s - (lo or 0)) % k == 0))
    if isinstance(steps, int) and not isinstance(steps, bool):
        return lambda s: s == steps
    try:
        wanted = {int(s) for s in steps}
    except (TypeError, ValueError):
        raise ConfigError(f"steps must be a step, a list of steps, a range or a slice, got {steps!r}") from None
    return wanted.__contains__


def lineage_points(run: "RunIndex", steps: Any, branch: str | None) -> list[tuple[str, int]]:
    """(branch, step) of the selected steps (:func:`step_filter`) of the
    branch's lineage, in step order; ConfigError when none is selected."""
    from dstt.errors import ConfigError

    want = step_filter(steps)
    pts = [(b, s) for b, ss in run.lineage(branch) for s in ss if want(s)]
    if not pts:
        raise ConfigError(f"no committed step of branch {branch or run.default_branch!r} matches steps={steps!r}")
    return pts


def parse_slice(text: str) -> tuple[Any, ...]:
    """Parse a NumPy-style index such as ``"0:4,:"``, ``"3"``, ``"...,-1"``
    into a tuple of ints, slices and Ellipsis.

    >>> parse_slice("0:4,:")
    (slice(0, 4, None), slice(None, None, None))
    >>> parse_slice("...,-1")
    (Ellipsis, -1)
    """
    out: list[Any] = []
    for part in text.split(","):
        p = part.strip()
        try:
            if p == "...":
                out.append(Ellipsis)
            elif ":" in p:
                bits = p.split(":")
                if len(bits) > 3:
                    raise ValueError
                nums = [int(b) if b.strip() else None for b in bits]
                out.append(slice(*nums))
            else:
                out.append(int(p))
        except ValueError:
            raise InvalidReferenceError(
                f"bad slice {text!r}: expected comma-separated ints, 'a:b[:c]' or '...', e.g. '0:4,:'"
            ) from None
    return tuple(out)
