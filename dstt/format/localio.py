"""Writing a local file fast without filling the page cache.

A capture writes gigabytes per step. Through the page cache that costs a
kernel memcpy per byte, a writeback later, and evicts what the trainer keeps
cached (its dataset); measured here, buffered chunk writes slowed a CPU
training loop by ~0.3 s per GiB captured, O_DIRECT writes by ~0.1 s.

:func:`write_file` therefore writes the page-aligned prefix of a large,
page-aligned first buffer (a block of the capture's staging pool, which
hands out page-aligned blocks) with ``O_DIRECT``: the device reads it from
that memory, no copy. The rest -- the unaligned tail and the 4-byte CRC
trailer -- goes through the page cache. Where the filesystem refuses
``O_DIRECT`` (tmpfs) or the buffer is not aligned, everything is buffered,
and :func:`start_writeback` asks the kernel to start writing it at once
rather than when a tenth of RAM is dirty. Neither is a durability point:
the store's ``sync()`` (``syncfs``) is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import stat
import sys
from typing import Any, Callable, Sequence

import numpy as np

#: Alignment of O_DIRECT buffers, offsets and lengths (safe for 512 B and 4 KiB sectors).
DIRECT_ALIGN = 4096
#: Buffers smaller than this are written through the page cache (O_DIRECT's
#: synchronous device round trip does not pay for itself on small writes).
DIRECT_MIN_BYTES = 1 << 20

#: Buffered files of at least this many bytes get their writeback started at
#: once (:func:`start_writeback`); smaller ones (a step's index, names and
#: stats) are left to the commit's ``sync()``, which follows within
#: milliseconds: starting each one's I/O cost the capture helper a device
#: round of its own per file (issue 16).
WRITEBACK_MIN_BYTES = 256 << 10

_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: A chunk path that is a symlink is never followed (see LocalBackend).
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
#: ...and a FIFO there cannot block the open (no reader: ENXIO).
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def open_regular(path: str, flags: int, mode: int = 0o644) -> int:
    """``os.open`` for writing a store file: never through a final symlink,
    never blocking on a FIFO, and only onto a regular file -- a FIFO, device
    or socket planted in a store is refused (CorruptStoreError) before a byte
    is written (a block device node would otherwise be written through)."""
    from dstt.errors import CorruptStoreError

    try:
        fd = os.open(path, flags | _O_NOFOLLOW | _O_NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a FIFO nobody reads
            raise CorruptStoreError(f"refusing to write {path}: a FIFO (dstt stores hold only files)") from None
        raise
    st_mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(st_mode):
        os.close(fd)
        raise CorruptStoreError(f"refusing to write {path}: not a regular file (mode {stat.filemode(st_mode)}); "
                                "dstt stores hold only files")
    if _O_NONBLOCK:  # (no effect on regular files; cleared for clarity)
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_NONBLOCK)
    return fd


def libc_function(name: str, argtypes: list[Any]) -> Any:
    """A libc function returning int (errno kept), or None where this libc lacks it."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = (libc_function("sync_file_range", [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint])
                    if sys.platform.startswith("linux") else None)
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing ``fd``'s dirty pages now, without
    waiting (Linux; elsewhere a no-op). Errors surface at ``sync()``."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def address(buf: Any) -> int:
    """Memory address of a buffer's first byte."""
    return int(np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0])


def write_all(fd: int, data: Any) -> int:
    """Write all of ``data``; its length."""
    view = memoryview(data).cast("B")
    size = len(view)
    while view:
        n = os.write(fd, view)
        view = view[n:]
    return size


def direct_prefix(parts: Sequence[Any]) -> int:
    """How many leading bytes of ``parts[0]`` can go out with O_DIRECT (0: none)."""
    if not _O_DIRECT or not parts:
        return 0
    first = memoryview(parts[0]).cast("B")
    n = len(first) // DIRECT_ALIGN * DIRECT_ALIGN
    if n < DIRECT_MIN_BYTES or address(first) % DIRECT_ALIGN:
        return 0
    return n


class DirectState:
    """Whether O_DIRECT works on one store's filesystem: unknown until tried,
    then remembered (a refusal is not retried)."""

    def __init__(self, enabled: bool = True) -> None:
        self.ok: bool | None = None if enabled else False


def aligned(parts: Sequence[Any]) -> bool:
    """Whether every buffer of ``parts`` starts on a DIRECT_ALIGN boundary
    and is whole multiples of it long (O_DIRECT takes them as they are)."""
    for p in parts:
        view = memoryview(p).cast("B")
        if len(view) % DIRECT_ALIGN or address(view) % DIRECT_ALIGN:
            return False
    return True


#: Buffers one ``writev`` takes at most (Linux's IOV_MAX).
IOV_MAX = 1024


def write_file(path: str, parts: Sequence[Any], direct: DirectState) -> None:
    """Create or replace ``path`` with ``parts`` written back to back."""
    if _O_DIRECT and direct.ok is not False and len(parts) > 1 and sum(len(memoryview(p).cast("B")) for p in parts) \
            >= DIRECT_MIN_BYTES and aligned(parts):
        # Every buffer aligned (a gathered pack, packs.py): all of them
        # straight to the device, no copy, in as few calls as IOV_MAX allows.
        if _open_direct(path, direct, lambda fd: _writev_direct(fd, parts, direct)):
            return
    prefix = direct_prefix(parts) if direct.ok is not False else 0
    if prefix and _open_direct(path, direct, lambda fd: _write_direct(fd, parts, prefix, direct)):
        return
    fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        written = 0
        for part in parts:
            written += write_all(fd, part)
        if written >= WRITEBACK_MIN_BYTES:
            start_writeback(fd)
    finally:
        os.close(fd)


def _open_direct(path: str, direct: DirectState, write: Callable[[int], bool]) -> bool:
    """Create or replace ``path`` opened with O_DIRECT and ``write(fd)`` it;
    False (the caller writes it buffered) where this filesystem has no
    O_DIRECT or ``write`` kept nothing."""
    try:
        fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        direct.ok = False  # this filesystem has no O_DIRECT (tmpfs, some FUSE)
        return False
    try:
        return write(fd)
    finally:
        os.close(fd)


def _rest_buffered(fd: int, rest: Sequence[Any]) -> None:
    """``rest`` written through the page cache on ``fd`` (O_DIRECT turned off)."""
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
    for part in rest:
        write_all(fd, part)


def _writev_direct(fd: int, parts: Sequence[Any], direct: DirectState) -> bool:
    """Every (aligned) buffer of ``parts`` with O_DIRECT through ``writev``;
    a short write (its end aligned or not) is finished buffered. False
    (nothing kept) if the device refused the first aligned write."""
    views = [memoryview(p).cast("B") for p in parts]
    i = 0
    done = 0  # bytes written of views[i]
    try:
        while i < len(views):
            batch = [views[i][done:], *views[i + 1:i + IOV_MAX]]
            n = os.writev(fd, batch)
            while i < len(views) and n >= len(views[i]) - done:
                n -= len(views[i]) - done
                i, done = i + 1, 0
            done += n
            if done % DIRECT_ALIGN:  # a short write off the alignment: the rest buffered
                break
    except OSError as e:
        if e.errno != errno.EINVAL or i or done:
            raise
        direct.ok = False  # alignment stricter than DIRECT_ALIGN: buffered from now on
        return False
    direct.ok = True
    if i < len(views):
        _rest_buffered(fd, [views[i][done:], *views[i + 1:]])
    return True


def _write_direct(fd: int, parts: Sequence[Any], prefix: int, direct: DirectState) -> bool:
    """The aligned prefix with O_DIRECT, the rest buffered on the same fd;
    False (nothing kept) if the device refused the aligned write."""
    first = memoryview(parts[0]).cast("B")
    done = 0
    try:
        while done < prefix:
            done += os.write(fd, first[done:prefix])
            if done % DIRECT_ALIGN:  # a short write off the alignment: finish buffered
                break
    except OSError as e:
        if e.errno != errno.EINVAL or done:
            raise
        direct.ok = False  # alignment stricter than DIRECT_ALIGN: buffered from now on
        return False
    direct.ok = True
    _rest_buffered(fd, [first[done:], *parts[1:]])
    start_writeback(fd)
    return True


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return True
