"""``--follow`` of ``ls`` and ``history``: show the output again each time
the store gains (or loses) a committed step, until Ctrl-C -- a live run
watched as ``tail -f`` watches a log. Torch-free: it polls the step index
(the branch list and each branch's steps), never tensor data.

On a terminal the screen is redrawn; piped, each new output follows the
last after a ``--- HH:MM:SS: N steps ---`` line (``--json``: one JSON
document per change). Ctrl-C ends it with exit status 0.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

from dstt.cli.output import stderr, stdout

#: Seconds between two looks at the store (``--interval``).
DEFAULT_INTERVAL_S = 2.0


def fingerprint(store: str) -> tuple[tuple[str, int, int], ...]:
    """(branch, number of steps, latest step) of every branch: what changes
    when a step commits or is pruned."""
    from dstt.format.index import RunIndex
    from dstt.format.refs import Ref

    run = RunIndex(Ref.parse(store).store)
    try:
        out = []
        for b in run.branches():
            steps = run.steps(b)
            out.append((b, len(steps), steps[-1] if steps else -1))
        return tuple(out)
    finally:
        run.close()


def follow(show: Callable[[], None], store: str, *, interval: float = DEFAULT_INTERVAL_S, json_out: bool = False,
           max_updates: int | None = None) -> None:
    """Call ``show`` now and again whenever :func:`fingerprint` of ``store``
    changes, looking every ``interval`` seconds, until Ctrl-C (or
    ``max_updates`` outputs)."""
    from dstt.errors import ConfigError

    if not interval > 0:
        raise ConfigError(f"--interval must be a positive number of seconds, got {interval}")
    last = None
    shown = 0
    try:
        while max_updates is None or shown < max_updates:
            cur = fingerprint(store)
            if cur != last:
                if last is not None and not json_out:
                    if stdout.is_terminal:
                        stdout.clear()
                    else:
                        steps = sum(n for _, n, _ in cur)
                        stdout.print(f"--- {time.strftime('%H:%M:%S')}: {steps} steps ---")
                show()
                sys.stdout.flush()  # (piped: block-buffered otherwise)
                shown += 1
                last = cur
                if shown == 1 and not json_out:
                    stderr.print("following: the output is shown again as steps commit; Ctrl-C to stop")
            time.sleep(interval)
    except KeyboardInterrupt:
        stderr.print("stopped following")
