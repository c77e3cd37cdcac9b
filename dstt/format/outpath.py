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


def temp_path(path: str | os.PathLike[str]) -> str:
    """A temporary name next to ``path`` to write it through (then
    ``os.replace``), named like the store's atomic-write temporaries
    (``<name>.tmp-<pid>-<hex>``), after removing stale ones a killed writer
    of ``path`` left (:func:`remove_stale_temps`)."""
    import uuid

    remove_stale_temps(path)
    return f"{os.fspath(path)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def remove_stale_temps(path: str | os.PathLike[str]) -> list[str]:
    """Remove the temporaries of ``path`` whose process is gone (a SIGKILLed
    export leaves one as large as the export) or that are over an hour old
    (the rule of ``dstt gc``: dstt.format.gc.is_stale_temp); the names removed."""
    import shutil
    import stat
    import time

    from dstt.format.gc import is_stale_temp
    from dstt.format.localio import pid_alive

    p = Path(path).absolute()
    removed: list[str] = []
    try:
        names = os.listdir(p.parent)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        if not name.startswith(p.name + ".tmp-"):
            continue
        f = p.parent / name
        try:
            st = os.lstat(f)
            if is_stale_temp(name, now - st.st_mtime, pid_alive):
                if stat.S_ISDIR(st.st_mode):  # a directory export (--format zarr)
                    shutil.rmtree(f)
                else:
                    os.unlink(f)
                removed.append(str(f))
        except OSError:
            continue
    return removed
