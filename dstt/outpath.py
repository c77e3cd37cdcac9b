"""Checks on a file path dstt is asked to write (exports, plots), made before
any work so that a typo costs a one-line error, not a finished computation."""
from __future__ import annotations

import os
from pathlib import Path

from dstt.errors import ConfigError


def check_output_file(path: str | os.PathLike[str], what: str) -> Path:
    """Refuse ``path`` unless it names a file in an existing writable directory.

    ``what`` names the action for the message (``"export"``, ``"plot"``).

    >>> check_output_file("/nonexistent-dir/x.png", "plot")
    Traceback (most recent call last):
    dstt.errors.ConfigError: cannot plot to '/nonexistent-dir/x.png': /nonexistent-dir is not a writable directory
    """
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"cannot {what} to {os.fspath(path)!r}: it is a directory; give a file name")
    parent = p.absolute().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError(f"cannot {what} to {os.fspath(path)!r}: {parent} is not a writable directory")
    return p
