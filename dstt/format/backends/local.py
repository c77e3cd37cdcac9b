"""A store in a local directory, with real durability: ``sync()`` calls
``syncfs(2)`` on the store's filesystem (or fsyncs every file and directory it
wrote, where syncfs is unavailable), and ``put_atomic`` is write to a
temporary file, fsync, rename, fsync the directory. zarr's own LocalStore
renames but does not fsync, and costs a trip through its event loop per call,
so local stores do not go through it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import threading
import uuid
from pathlib import Path
from typing import Any

from dstt.errors import CorruptStoreError, StoreNotFoundError, StoreNotWritableError
from dstt.format.backends.base import Backend, Bytes, Data, check_key
from dstt.format.localio import DirectState, libc_function, write_all, write_file

_SYNCFS = libc_function("syncfs", [ctypes.c_int])


def _remaining(bufs: list[memoryview], skip: int) -> list[memoryview]:
    """``bufs`` without their first ``skip`` bytes."""
    out = []
    for b in bufs:
        if skip >= len(b):
            skip -= len(b)
            continue
        out.append(b[skip:])
        skip = 0
    return out


_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a file"


#: errno values that mean "this store cannot be written here".
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def not_writable(url: str, e: OSError) -> Exception:
    """StoreNotWritableError for ``e`` when it says the store cannot be
    written (read-only filesystem, permissions); ``e`` itself otherwise."""
    if e.errno in _NOT_WRITABLE:
        return StoreNotWritableError(f"cannot write to the store {url}: {e.strerror} ({e.filename or url}); "
                                     "open it read-only (dstt.open) or copy it somewhere writable")
    return e


def _check_size(key: str, size: int, max_bytes: int | None) -> None:
    if max_bytes is not None and size > max_bytes:
        raise CorruptStoreError(f"refusing {key!r}: {size} bytes, more than the {max_bytes} it can hold")


class LocalBackend(Backend):
    """A store in a local directory with explicit durability.

    Large page-aligned chunk buffers are written with O_DIRECT where the
    filesystem allows it (``direct_io=False`` turns that off); see
    :mod:`dstt.format.localio`.

    dstt never creates links inside a store, so a link is hostile or broken:
    every file is opened without following a final symlink, and every
    directory used must resolve inside the store's real root. Either way the
    access is refused with :class:`CorruptStoreError`, so a store handed to
    you can neither make dstt read from nor write to a path outside it.
    """

    durable_sync = True
    flock = True
    atomic_create = True  # O_CREAT | O_EXCL
    can_readinto = True
    directories = True
    group_sync = _SYNCFS is not None  # (without syncfs, sync() fsyncs file by file)

    def __init__(self, root: str | os.PathLike[str], *, create: bool = False, direct_io: bool = True) -> None:
        self.root = Path(root).absolute()
        self.url = str(self.root)
        if not self.root.exists():
            if not create:
                raise StoreNotFoundError(f"no store at {self.root}: the path does not exist")
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise not_writable(self.url, e) from None
        elif not self.root.is_dir():
            raise StoreNotFoundError(f"no store at {self.root}: not a directory")
        self._lock = threading.Lock()
        self._direct = DirectState(direct_io)
        self._real_root = os.path.realpath(self.url)
        self._inside: set[str] = set()  # directories known to resolve inside the store
        self._made_dirs: set[str] = set()
        # Only used where syncfs(2) is unavailable: what sync() must fsync.
        self._dirty_files: set[str] = set()
        self._dirty_dirs: set[str] = set()

    @property
    def gather_direct(self) -> bool:
        """Whether ``put`` writes page-aligned buffers straight to the device
        (O_DIRECT, not known refused here): a gathered pack's chunks are
        then written where they lie (packs.StepPacks.borrow)."""
        return self._direct.ok is not False

    # -- helpers
    def _path(self, key: str, *, directory: bool = False) -> str:
        """The local path of ``key`` (a file, or a ``directory``), after checking
        that the directory holding it resolves inside the store."""
        path = os.path.join(self.url, *check_key(key).split("/"))
        self._check_inside(path if directory else os.path.dirname(path), key)
        return path

    def _check_inside(self, directory: str, key: str) -> None:
        if directory in self._inside:
            return
        parent = os.path.dirname(directory)
        if parent == self.url or parent in self._inside:
            # One lstat instead of realpath's one per path component (a
            # listing of 1,000 steps checks 1,000 new step directories): a
            # real directory (or none yet) inside a directory known to be
            # inside is inside. A symbolic link takes the full check below.
            try:
                is_link = stat.S_ISLNK(os.lstat(directory).st_mode)
            except (FileNotFoundError, NotADirectoryError):
                is_link = False
            if not is_link:
                with self._lock:
                    self._inside.add(directory)
                return
        real = os.path.realpath(directory)
        if real != self._real_root and not real.startswith(self._real_root + os.sep):
            raise CorruptStoreError(
                f"refusing {key!r} in {self.url}: a symbolic link in the store leads outside it (to {real})")
        with self._lock:
            self._inside.add(directory)

    def _open(self, path: str, flags: int, mode: int = 0o644) -> int:
        """``os.open`` that refuses to follow a symlink at ``path``."""
        try:
            return os.open(path, flags | _O_NOFOLLOW, mode)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CorruptStoreError(
                    f"refusing {path}: a symbolic link inside the store (dstt stores hold none)") from None
            raise

    def _ensure_parent(self, path: str) -> None:
        parent = os.path.dirname(path)
        if parent in self._made_dirs:
            return
        missing = []
        p = parent
        while not os.path.isdir(p):
            missing.append(p)
            p = os.path.dirname(p)
        os.makedirs(parent, exist_ok=True)
        with self._lock:
            self._made_dirs.add(parent)
            if _SYNCFS is None:
                # New directory entries are durable only once their parent is fsynced.
                self._dirty_dirs.update(os.path.dirname(m) for m in missing)
                self._dirty_dirs.add(parent)

    _write_all = staticmethod(write_all)

    # -- interface
    def put(self, key: str, data: Data) -> None:
        path = self._path(key)
        try:
            self._ensure_parent(path)
            write_file(path, data if isinstance(data, (list, tuple)) else (data,), self._direct)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CorruptStoreError(
                    f"refusing {path}: a symbolic link inside the store (dstt stores hold none)") from None
            raise not_writable(self.url, e) from None
        if _SYNCFS is None:
            with self._lock:
                self._dirty_files.add(path)

    def _write_temp(self, path: str, data: Bytes) -> str:
        tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self._ensure_parent(path)
            fd = self._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except OSError as e:
            raise not_writable(self.url, e) from None
        try:
            self._write_all(fd, data)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        return tmp

    @staticmethod
    def _fsync_dir(path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def put_atomic(self, key: str, data: Bytes) -> None:
        path = self._path(key)
        tmp = self._write_temp(path, data)
        os.replace(tmp, path)
        self._fsync_dir(os.path.dirname(path))

    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` to ``dst`` atomically (replacing it); durable at the
        next :meth:`sync` (format/groupcommit.py publishes commit markers so)."""
        os.replace(self._path(src), self._path(dst))
        if _SYNCFS is None:
            with self._lock:
                self._dirty_dirs.add(os.path.dirname(self._path(dst)))

    def put_if_absent(self, key: str, data: Bytes) -> bool:
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            os.link(tmp, path)  # atomic, fails if the name exists
            created = True
        except FileExistsError:
            created = False
        finally:
            os.unlink(tmp)
        if created:
            self._fsync_dir(os.path.dirname(path))
        return created

    def _open_regular(self, key: str) -> int | None:
        """A read-only descriptor of the regular file ``key``; None if there
        is no such file (or a directory stands there). Anything else -- a
        FIFO, a device, a socket -- is refused: opened with O_NONBLOCK so a
        FIFO cannot block the open, then checked with fstat, so neither an
        endless read (/dev/zero) nor a read waiting on a writer happens."""
        try:
            fd = self._open(self._path(key), os.O_RDONLY | _O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            return None
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            return fd
        os.close(fd)
        if stat.S_ISDIR(mode):
            return None
        raise CorruptStoreError(
            f"refusing {key!r} in {self.url}: not a regular file ({_file_kind(mode)}; dstt stores hold only files)")

    def _open_read(self, key: str) -> Any:
        """A binary file object for ``key``, or None if there is no such file."""
        fd = self._open_regular(key)
        return None if fd is None else os.fdopen(fd, "rb")

    def get(self, key: str, *, max_bytes: int | None = None) -> bytearray | None:  # type: ignore[override]
        """The file's bytes; a file longer than ``max_bytes`` (when given) is
        refused with CorruptStoreError before anything is read."""
        # A bytearray (same cost as bytes): arrays over it are writable, so
        # torch.from_numpy takes them without a warning or a copy.
        f = self._open_read(key)
        if f is None:
            return None
        with f:
            size = os.fstat(f.fileno()).st_size
            _check_size(key, size, max_bytes)
            buf = bytearray(size)
            n = f.readinto(buf)
            if n == size and not f.read(1):
                return buf
            f.seek(0)  # the file changed under us: read what is there now (bounded)
            limit = -1 if max_bytes is None else max_bytes + 1
            data = bytearray(f.read(limit))
            _check_size(key, len(data), max_bytes)
            return data

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        f = self._open_read(key)
        if f is None:
            return None
        with f:
            f.seek(start)
            data: bytes = f.read(length)
            return data

    def readinto(self, key: str, out: memoryview | list[memoryview]) -> int | None:
        """Read a whole file into ``out`` (one buffer, or several filled in
        order); the number of bytes read, or None if the file is missing.
        One byte more than fits is reported as read, so a longer file shows."""
        bufs = [memoryview(b).cast("B") for b in (out if isinstance(out, list) else [out])]
        size = sum(len(b) for b in bufs)
        fd = self._open_regular(key)
        if fd is None:
            return None
        try:
            total = 0
            while total < size:
                n = os.readv(fd, _remaining(bufs, total))
                if n == 0:
                    break
                total += n
            if total == size and os.read(fd, 1):
                total += 1  # longer than expected: let the caller report it
            return total
        finally:
            os.close(fd)

    def temp_files(self) -> list[tuple[str, float]]:
        """(key, mtime) of every temporary file of an atomic write in the
        store (``<name>.tmp-<pid>-<hex>``; listings hide them): what a killed
        writer leaves behind, for gc."""
        out = []
        for dirpath, _dirs, files in os.walk(self.url):
            rel = os.path.relpath(dirpath, self.url).replace(os.sep, "/")
            for f in files:
                if ".tmp-" in f:
                    try:
                        mtime = os.lstat(os.path.join(dirpath, f)).st_mtime
                    except FileNotFoundError:
                        continue
                    out.append((f if rel == "." else f"{rel}/{f}", mtime))
        return sorted(out)

    def stat_dir(self, prefix: str) -> os.stat_result | None:
        """``lstat`` of the directory ``prefix`` (None if it is not one): its
        mtime and link count change whenever an entry is made or removed in
        it (dstt.format.heads checks a branch's steps directory this way)."""
        try:
            st = os.lstat(self._path(prefix, directory=True))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st if stat.S_ISDIR(st.st_mode) else None

    def _lstat(self, key: str) -> os.stat_result | None:
        try:
            return os.lstat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            return None

    def exists(self, key: str) -> bool:
        st = self._lstat(key)
        return st is not None and stat.S_ISREG(st.st_mode)

    def size(self, key: str) -> int | None:
        st = self._lstat(key)
        return st.st_size if st is not None and stat.S_ISREG(st.st_mode) else None

    def list_dir(self, prefix: str) -> list[str]:
        path = self._path(prefix, directory=True) if prefix.strip("/") else self.url
        try:
            return sorted(n for n in os.listdir(path) if ".tmp-" not in n)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def list_prefix(self, prefix: str) -> list[str]:
        base = self._path(prefix, directory=True) if prefix.strip("/") else self.url
        out = []
        for dirpath, _dirs, files in os.walk(base):
            rel = os.path.relpath(dirpath, self.url).replace(os.sep, "/")
            for f in files:
                out.append(f if rel == "." else f"{rel}/{f}")
        return sorted(out)

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    def delete_prefix(self, prefix: str) -> None:
        import shutil

        path = self._path(prefix, directory=True)
        shutil.rmtree(path, ignore_errors=True)
        with self._lock:
            self._made_dirs = {d for d in self._made_dirs if not (d == path or d.startswith(path + os.sep))}

    def remove_empty_dirs(self, prefix: str) -> None:
        root = self._path(prefix, directory=True)
        for dirpath, _dirs, _files in os.walk(root, topdown=False):
            if dirpath == root:
                continue
            try:
                os.rmdir(dirpath)
            except OSError:
                pass

    def sync(self) -> None:
        if _SYNCFS is not None:
            fd = os.open(self.url, os.O_RDONLY)
            try:
                if _SYNCFS(fd) != 0:
                    e = ctypes.get_errno()
                    raise OSError(e, f"syncfs failed on {self.url}: {os.strerror(e)}")
            finally:
                os.close(fd)
            return
        with self._lock:
            files, dirs = self._dirty_files, self._dirty_dirs
            self._dirty_files, self._dirty_dirs = set(), set()
        for path in files:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        for path in dirs:
            try:
                self._fsync_dir(path)
            except OSError as e:  # pragma: no cover - platform specific
                if e.errno not in (errno.EINVAL, errno.ENOENT):
                    raise
