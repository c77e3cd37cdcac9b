"""References to a point in a captured run: ``STORE[@BRANCH][:STEP]``.

STEP is a step number, ``latest``, or ``~N`` (N captured steps before the
latest). STORE is a path or URL (``s3://bucket/run:100`` parses as store
``s3://bucket/run``, step 100). The same syntax is used by the CLI and by
``dstt.open``.

>>> Ref.parse("runs/exp1@lr-sweep:~2")
Ref(store='runs/exp1', branch='lr-sweep', step='~2')
>>> Ref.parse("s3://bucket/run:100")
Ref(store='s3://bucket/run', branch=None, step=100)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Protocol

from dstt.errors import InvalidReferenceError, StepNotFoundError
from dstt.format.backends import Backend
from dstt.format.layout import StepRef

_STEP_RE = re.compile(r":(latest|\d+|~\d+)$")
_BRANCH_RE = re.compile(r"@([A-Za-z0-9][A-Za-z0-9._-]{0,127})$")
_RELATIVE_RE = re.compile(r"(?:@([A-Za-z0-9][A-Za-z0-9._-]{0,127}))?(?::(latest|\d+|~\d+))?\Z")

StepSpec = int | str | None

__all__ = ["Ref", "StepRef", "StepSpec", "resolve_step"]


class Run(Protocol):
    """What resolving a step asks of an open run
    (:class:`dstt.format.index.RunIndex` is one)."""

    @property
    def backend(self) -> Backend: ...

    def lineage(self, branch: str | None = None, ancestry: bool = True) -> list[tuple[str, list[int]]]: ...


@dataclass(frozen=True)
class Ref:
    store: str
    branch: str | None = None
    step: StepSpec = None

    @classmethod
    def parse(cls, text: str) -> "Ref":
        """Split ``STORE[@BRANCH][:STEP]``; raise InvalidReferenceError if malformed."""
        if not isinstance(text, str) or not text.strip():
            raise InvalidReferenceError("empty reference: expected STORE[@BRANCH][:STEP]")
        rest = text
        step: StepSpec = None
        m = _STEP_RE.search(rest)
        if m and m.start() == 0:
            raise InvalidReferenceError(f"reference {text!r} names no store: expected STORE[@BRANCH][:STEP]")
        if m and m.start() > 0:
            spec = m.group(1)
            step = _step_number(spec, text) if spec.isdigit() else spec
            rest = rest[: m.start()]
        else:
            colon = rest.rfind(":")
            # An existing path is a store, whatever its name holds (dstt.save takes any path).
            if colon > 0 and colon != rest.find("://") and colon > rest.rfind("/") and not os.path.exists(text):
                raise InvalidReferenceError(
                    f"bad step {rest[colon + 1:]!r} in reference {text!r}: "
                    "expected a number, 'latest' or '~N'"
                )
        branch = None
        if not os.path.exists(rest):
            b = _BRANCH_RE.search(rest)
            if b:
                branch = b.group(1)
                rest = rest[: b.start()]
            elif "@" in rest.rsplit("/", 1)[-1]:
                tail = rest.rsplit("@", 1)[-1]
                raise InvalidReferenceError(
                    f"bad branch {tail!r} in reference {text!r}: expected letters, digits, '.', '_' or '-'"
                )
        if not rest:
            raise InvalidReferenceError(f"reference {text!r} names no store")
        return cls(rest, branch, step)

    @staticmethod
    def parse_relative(text: str) -> tuple[str | None, StepSpec]:
        """(branch, step) of a reference relative to a known store:
        ``:STEP``, ``@BRANCH`` or ``@BRANCH:STEP`` (None where omitted).

        >>> Ref.parse_relative("@side"), Ref.parse_relative(":~1")
        (('side', None), (None, '~1'))
        """
        m = _RELATIVE_RE.match(text)
        if not m or not text:
            raise InvalidReferenceError(
                f"bad relative reference {text!r}: expected ':STEP', '@BRANCH' or '@BRANCH:STEP' "
                "(STEP: a number, 'latest' or '~N')"
            )
        spec = m.group(2)
        return m.group(1), (_step_number(spec, text) if spec and spec.isdigit() else spec)

    def __str__(self) -> str:
        out = self.store
        if self.branch:
            out += f"@{self.branch}"
        if self.step is not None:
            out += f":{self.step}"
        return out


def _step_number(digits: str, text: str) -> int:
    """A step number of a reference; past the 20 digits of step directories
    it is a reference error, not a step that merely is not there."""
    from dstt.format.layout import STEP_DIGITS

    if len(digits.lstrip("0")) > STEP_DIGITS:
        raise InvalidReferenceError(f"step {digits[:40]} in reference {text[:200]!r} is out of range "
                                    f"(at most {STEP_DIGITS} digits)")
    return int(digits)


#: ``BRANCH:STEP`` (or a bare ``BRANCH``) inside a known store.
_IN_STORE_RE = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]{0,127})(?::(latest|\d+|~\d+))?\Z")


def split_in_store(text: str) -> tuple[str | None, StepSpec] | None:
    """(branch, step) of a reference relative to a known store, or None when
    ``text`` is a full reference (``STORE[@BRANCH][:STEP]``). The one rule
    for every place that takes a step of "this" store (``parent=``, the CLI's
    ``--from``, the other side of a diff):

    * ``:STEP``, ``@BRANCH``, ``@BRANCH:STEP`` (see :meth:`Ref.parse_relative`);
    * ``latest``, ``~N`` or a step number, on the default branch;
    * ``BRANCH:STEP`` or ``BRANCH``, when no path of that name exists.

    >>> split_in_store("main:1200"), split_in_store("@side"), split_in_store("~3")
    (('main', 1200), ('side', None), (None, '~3'))
    >>> split_in_store("runs/other:5") is None
    True
    """
    if text.startswith((":", "@")):
        return Ref.parse_relative(text)
    if text == "latest" or (text.startswith("~") and text[1:].isdigit()):
        return None, text
    if text.isdigit():
        return None, Ref.parse_relative(":" + text)[1]
    m = _IN_STORE_RE.match(text)
    if m and not os.path.exists(m.group(1)):
        return Ref.parse_relative(f"@{text}")
    return None


def parent_arg(value: object) -> StepRef | str | None:
    """The ``parent=`` argument checked (every entry point's one validator
    of it): None; a reference inside the store (``"main:1200"``,
    ``"@main"``, ``"~3"``: :func:`split_in_store`; resolved against the
    store later); or a ``(branch, step)`` pair -- a StepRef, a tuple or a
    list -- of a valid branch name and step number, returned as a StepRef.

    >>> parent_arg(["main", 3]), parent_arg("main:3")
    (StepRef(branch='main', step=3), 'main:3')
    >>> parent_arg(("main", 1.5))
    Traceback (most recent call last):
    dstt.errors.StepOrderError: parent step must be an integer in 0..99999999999999999999, got 1.5
    """
    from dstt.format import args as A

    if value is None:
        return None
    if isinstance(value, str):
        try:
            ok = split_in_store(value) is not None
        except InvalidReferenceError:
            ok = False
        if not ok:
            raise InvalidReferenceError(f"parent {A.shown(value)} is not a step of this store: use 'BRANCH:STEP', "
                                        "'@BRANCH[:STEP]', ':STEP', '~N', a StepRef or (branch, step)")
        return value
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise InvalidReferenceError(f"parent must be a reference string, a StepRef or a (branch, step) pair, "
                                    f"got {A.shown(value)}")
    return StepRef(A.branch(value[0]), A.step(value[1], "parent step"))


def resolve_step(run: Run, branch: str, spec: StepSpec) -> StepRef:
    """The (branch, step) a step spec (number, 'latest', '~N', None = latest)
    names on ``branch``'s trajectory: its own steps, after its ancestors'
    steps up to each fork point (:meth:`Run.lineage`)."""
    if spec is None or spec == "latest":
        from dstt.format.heads import head_record
        from dstt.format.layout import validate_branch
        from dstt.format.root import load_branch

        load_branch(run.backend, validate_branch(branch))
        head = head_record(run.backend, branch)  # O(1) where the head agrees with the markers
        if head is not None and head.step is not None:
            return StepRef(branch, head.step)
    segs = run.lineage(branch)
    trajectory = [(b, s) for b, steps in segs for s in steps]
    own = segs[-1][1]
    if spec is None or spec == "latest":
        if not trajectory:
            raise StepNotFoundError(f"branch {branch!r} has no committed steps")
        return StepRef(*trajectory[-1])
    if isinstance(spec, str) and spec.startswith("~"):
        if not spec[1:].isdigit():
            raise InvalidReferenceError(f"bad step {spec!r}: '~N' takes a non-negative number")
        back = int(spec[1:])
        if back >= len(trajectory):
            raise StepNotFoundError(
                f"~{back} goes before the first step: branch {branch!r} has {len(trajectory)} steps"
                + (f" ({len(own)} of its own)" if len(segs) > 1 else "")
            )
        return StepRef(*trajectory[-1 - back])
    if isinstance(spec, int) and not isinstance(spec, bool):
        for b, steps in reversed(segs):
            if spec in steps:
                return StepRef(b, spec)
        have = "; ".join(f"{b}: {_span(steps)}" for b, steps in segs)
        where = "it has" if len(segs) == 1 else "its trajectory has"
        raise StepNotFoundError(f"no committed step {spec} on branch {branch!r} ({where} {have})")
    raise InvalidReferenceError(f"bad step {spec!r}: expected a number, 'latest' or '~N'")


def _span(steps: list[int]) -> str:
    if not steps:
        return "no steps"
    return f"{steps[0]}..{steps[-1]} ({len(steps)} step{'s' if len(steps) != 1 else ''})"
