"""One output sink for every command: rich tables for people, JSON for
scripts. Data goes to stdout; messages, progress and errors to stderr.

Errors map to exit codes: 2 for usage (bad reference, bad option value),
1 for everything else dstt reports; never a traceback unless ``--debug`` or
``DSTT_DEBUG=1`` is set.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys
from typing import Any, Callable, Iterable, ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.segment import Segment
from rich.text import Text

from dstt import knobs
from dstt.errors import (
    ConfigError,
    DsttError,
    InvalidNameError,
    InvalidReferenceError,
)

P = ParamSpec("P")
T = TypeVar("T")

#: DsttError subclasses that are the user's usage mistakes (exit code 2).
USAGE_ERRORS: tuple[type[BaseException], ...] = (InvalidReferenceError, InvalidNameError, ConfigError)

#: Characters that must never reach a terminal raw from data (tensor and
#: branch names, paths, values, messages): C0 controls but newline (ESC starts
#: escape sequences; CR/BS rewrite what was printed), DEL, C1 controls (CSI
#: 0x9b) and the bidirectional overrides/isolates that reorder text.
_UNPRINTABLE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_UNPRINTABLE_LINE = re.compile(_UNPRINTABLE.pattern[:-1] + "\n]")


def _escape_char(m: re.Match[str]) -> str:
    c = m.group()
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def printable(text: str, *, line: bool = True) -> str:
    r"""``text`` with control characters escaped as ``\x1b`` / ``\u202e``
    (newlines too unless ``line=False``): how data from a store or the
    command line is shown to people. ``--json`` output keeps data exact.

    >>> printable("evil\x1b[2Jname\n")
    'evil\\x1b[2Jname\\x0a'
    """
    return (_UNPRINTABLE_LINE if line else _UNPRINTABLE).sub(_escape_char, text)


class _SafeConsole(Console):
    """A Console that escapes control characters in everything it prints
    (styles still render): whatever a command forgets to pass through
    :func:`printable`, a terminal never receives an escape sequence from data."""

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        return super()._render_buffer(
            seg if seg.control else Segment(_UNPRINTABLE.sub(_escape_char, seg.text), seg.style, seg.control)
            for seg in buffer)


# No console markup: what is printed is data (paths, tensor names, user input),
# and ``[`` in it must print as is, not style or break the output. Styling
# goes through rich Text objects or an explicit ``style=``.
stdout = _SafeConsole(highlight=False, soft_wrap=True, markup=False)
stderr = _SafeConsole(stderr=True, highlight=False, soft_wrap=True, markup=False)


def debug_enabled() -> bool:
    return knobs.debug()


def _json_default(o: Any) -> Any:
    if isinstance(o, (set, tuple)):
        return list(o)
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def _clean(o: Any) -> Any:
    """Non-finite floats become null so the output is strict JSON."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def emit_json(data: Any) -> None:
    """Write ``data`` as strict JSON (NaN/Inf as null) to stdout."""
    sys.stdout.write(json.dumps(_clean(data), default=_json_default, allow_nan=False, indent=2) + "\n")
    sys.stdout.flush()


#: ``--json`` of the inspection commands (ls, show, diff, history, find).
JSON_OPT = typer.Option(False, "--json", help="Machine-readable output on stdout.")


def fail(message: str, code: int = 1) -> "typer.Exit":
    stderr.print(Text.assemble(("error:", "bold red"), " ", message))
    return typer.Exit(code)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null once its reader has gone (``dstt ls | head``),
    so that flushing it at exit raises nothing either."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a real file (tests' captured output)
        pass


def handle_errors(fn: Callable[P, T]) -> Callable[P, T]:
    """Turn dstt errors into one line on stderr and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except BrokenPipeError:  # the reader of stdout went away: nothing left to tell anyone
            _quiet_stdout()
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            stderr.print("interrupted")
            raise typer.Exit(130) from None
        except Exception as e:  # one line unless debugging
            if debug_enabled():
                raise
            code = 2 if isinstance(e, USAGE_ERRORS) else 1
            msg = str(e) if isinstance(e, DsttError) else f"{type(e).__name__}: {e}"
            raise fail(msg.splitlines()[0] if msg else type(e).__name__, code) from None

    return wrapper


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_float(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, int):
        return str(x)
    return f"{x:.{digits}g}"
