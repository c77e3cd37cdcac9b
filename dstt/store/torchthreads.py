"""Fewer torch threads for one thread of the trainer's process, never for
the process: dstt never changes the training it watches (issue 23).

``torch.set_num_threads`` is no per-thread setting: besides the calling
thread's OpenMP team size it stores a process-wide count that every thread
adopts at its first parallel operation (torch 2.x, ``at::init_num_threads``),
so a background thread calling it leaves a trainer that had not run an
operation yet -- and every thread the trainer starts later -- on one thread
(nanoGPT: +62 % per iteration, weights 1-3 ULP off from iteration 6).

What a background thread wants is only its *own* operations on one thread
(with OpenMP each calling thread runs its own team; a background team
preempts the trainer's, whose workers spin at each barrier: docs/benchmarks.md,
issue 16). That is the OpenMP runtime's per-thread ``nthreads-var``, set here
through the runtime torch is linked with (``omp_set_num_threads`` acts on the
calling thread only). torch's process-wide count, its thread pools, MKL's
settings and every other thread are left alone.

Where no OpenMP runtime is found (another platform, torch built with its
native thread pool, where the count is process-wide), nothing is changed:
the background work then runs on torch's default thread count.

>>> import threading, torch
>>> seen = []
>>> def background():
...     seen.append(limit_this_thread())
...     seen.append(torch.get_num_threads())
>>> t = threading.Thread(target=background); t.start(); t.join()
>>> seen == [True, 1] or not openmp_runtimes()
True
>>> with single_threaded():
...     inside = torch.get_num_threads()
>>> inside == 1 or not openmp_runtimes()
True
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

log = logging.getLogger("dstt")

#: File names of OpenMP runtimes: GNU (libgomp, torch's Linux wheels bundle
#: one as libgomp-<hash>.so.1), Intel (libiomp5) and LLVM (libomp).
_RUNTIME_NAME = re.compile(r"^lib(gomp|iomp5|omp)([-.].*)?\.(so|dylib)(\..*)?$")

_lock = threading.Lock()
_found: list[tuple[Any, Any]] | None = None  # (omp_set_num_threads, omp_get_max_threads) per runtime


def openmp_runtimes() -> list[tuple[Any, Any]]:
    """``(omp_set_num_threads, omp_get_max_threads)`` of every OpenMP runtime
    loaded in this process (Linux: from /proc/self/maps; opened with
    RTLD_NOLOAD, so the very instance torch uses and never a new one).
    Found once (torch is imported before dstt: its runtime is loaded)."""
    global _found
    with _lock:
        if _found is None:
            _found = _find_runtimes()
        return _found


def _find_runtimes() -> list[tuple[Any, Any]]:
    if not sys.platform.startswith("linux"):
        return []
    paths: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.rstrip("\n").split(None, 5)  # address perms offset dev inode [path]
                path = parts[5] if len(parts) == 6 else ""
                if path.startswith("/") and _RUNTIME_NAME.match(os.path.basename(path)) and path not in paths:
                    paths.append(path)
    except OSError as e:
        log.debug("dstt: cannot read /proc/self/maps (%s): torch threads of background work unchanged", e)
        return []
    found = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | os.RTLD_LOCAL)
            set_, get_ = lib.omp_set_num_threads, lib.omp_get_max_threads
        except (OSError, AttributeError) as e:
            log.debug("dstt: OpenMP runtime %s not usable (%s)", path, e)
            continue
        set_.argtypes, set_.restype = [ctypes.c_int], None
        get_.argtypes, get_.restype = [], ctypes.c_int
        found.append((set_, get_))
    return found


def limit_this_thread() -> bool:
    """Run the calling thread's torch operations on one thread, for the
    rest of its life (a background thread of dstt calls it first thing).
    True if torch now reports one thread here; False where no OpenMP runtime
    was found (then nothing was changed)."""
    torch.get_num_threads()  # torch's per-thread initialisation first: it would set the count at the first operation
    runtimes = openmp_runtimes()
    for set_, _get in runtimes:
        set_(1)
    return bool(runtimes) and torch.get_num_threads() == 1


@contextmanager
def single_threaded() -> Iterator[None]:
    """The calling thread's torch operations on one thread for the block,
    its own thread count put back after (any thread, the trainer's included:
    the count is the thread's own; no other thread and no process-wide
    setting sees the change). A no-op where the thread already runs one."""
    if torch.get_num_threads() == 1:
        yield
        return
    saved = [(set_, get_()) for set_, get_ in openmp_runtimes()]
    for set_, _n in saved:
        set_(1)
    try:
        yield
    finally:
        for set_, n in saved:
            set_(n)


__all__ = ["limit_this_thread", "openmp_runtimes", "single_threaded"]
