"""``ARGS --next ARGS ...`` on a training script's command line: several
runs, one after another in one process (the tests pay the interpreter and
the library imports once). Imported by the scripts beside it."""

from __future__ import annotations


def runs(argv: list[str]) -> list[list[str]]:
    """Each run's arguments, in order.

    >>> runs(["--a", "1", "--next", "--b"])
    [['--a', '1'], ['--b']]
    """
    out: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--next":
            out.append([])
        else:
            out[-1].append(arg)
    return out
