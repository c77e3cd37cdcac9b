"""One writer per branch: the branch write lock.

Every :class:`~dstt.store.writer.Writer` (rank 0 under torch.distributed)
holds ``meta/locks/<branch>.lock`` for its lifetime. A second writer on the
same branch -- in another process or the same one -- gets a
:class:`~dstt.errors.StoreLockedError` naming the holder (pid, host, since
when). Writers on different branches never contend.

Local stores (:class:`~dstt.format.backends.LocalBackend`) use ``flock(2)`` on
the lock file, held open for the writer's lifetime, so the kernel releases it
when the writer dies, SIGKILL included: a crashed writer never leaves a stale
lock. The file also holds a JSON record of the holder, for messages only.
``flock`` is per open file description, so two writers in one process exclude
each other too. On network filesystems ``flock`` is only as good as the
filesystem's lock support (NFSv4 emulates it with byte-range locks).

Other backends (object stores, fsspec URLs) get a *lease*: a JSON file with
holder, time and expiry, created with ``put_if_absent`` and renewed by a
daemon thread every ``ttl / 3`` seconds. A writer that dies leaves the lease
until it expires (``ttl``, default 60 s) -- unless it died on the host that
looks: a record names the holder's host, boot id, PID namespace and start
time, so a holder that is provably dead there (:meth:`LockInfo.gone`) leaves
a stale lease, taken over at once and never called a live writer. This is weaker: it relies on
clocks agreeing within the ttl and on the store's conditional create being
atomic (S3 ``If-None-Match: *``). The first lease a process takes on a
store checks that (a backend's ``check_atomic_create``: a second create of
a probe object must be refused) and refuses a store that ignores it; a
backend that cannot check and is not ``atomic_create`` gets a warning.
Renewing a lease and taking over an expired one replace the object only if
it is unchanged (``put_if_unchanged``: S3 ``If-Match``), so neither can
overwrite another writer's newer lease. A writer paused for longer than the
ttl loses its lease; it finds out at its next :meth:`BranchLock.check`.
See docs/object-stores.md.

A lock whose holder is gone can be removed with :func:`break_lock`
(``dstt unlock STORE@BRANCH``). A lock whose holder is provably alive -- on a
local store its ``flock`` is still held (a writer stopped with SIGSTOP holds
it too), elsewhere its lease has not expired -- is refused unless
``force=True`` (``--force``). A writer checks that it still holds its lock
(:meth:`BranchLock.check`: same lock file, same token, lease unexpired)
when it plans a step and again right before writing the step's commit
marker, so a writer whose lock was broken fails that step with
StoreLockedError instead of committing over the next writer's steps.

>>> import tempfile
>>> from dstt.format.backends import LocalBackend
>>> b = LocalBackend(tempfile.mkdtemp())
>>> lock = acquire(b, "main")
>>> try:
...     acquire(b, "main")
... except StoreLockedError as e:
...     print("refused")
refused
>>> lock.release()
>>> acquire(b, "main").release()
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import threading
import time
import uuid
import weakref
from typing import Any, Iterator, cast

from dstt.errors import CorruptStoreError, StoreLockedError, StoreWarning
from dstt.format import args as A
from dstt.format import layout as L
from dstt.format.backends import Backend, open_backend
from dstt.format.backends.local import LocalBackend, not_writable
from dstt.format.lockinfo import LockInfo, _record

#: Default lease lifetime for non-local backends, in seconds.
LEASE_TTL = 60.0
#: A lock record is a few hundred bytes; a bigger one is not read whole.
LOCK_RECORD_MAX_BYTES = 64 << 10


#: The lock of the store's set of branches (not a branch: branch names start
#: with a letter or digit). Held while a branch is created and for the whole
#: of a prune or gc, so no branch can fork from a step being deleted.
BRANCH_SET = "_branches"


def _locked_error(backend: Backend, branch: str, info: LockInfo) -> StoreLockedError:
    if branch == BRANCH_SET:
        return StoreLockedError(
            f"the branches of {backend.url} are being changed by {info.describe()} "
            f"(a prune or gc, or a branch being created); try again when it is done"
        )
    return StoreLockedError(
        f"branch {branch!r} of {backend.url} is being written by {info.describe()}; "
        f"only one writer per branch (if that writer is gone, run: dstt unlock {backend.url}@{branch})"
    )


class BranchLock:
    """A held branch lock; :meth:`release` (or the holder's death) frees it."""

    def __init__(self, backend: Backend, branch: str) -> None:
        self.backend = backend
        self.branch = branch if branch == BRANCH_SET else L.validate_branch(branch)
        self.key = L.lock_key(branch)
        self.token = uuid.uuid4().hex
        self._fd: int | None = None
        self._held_file: tuple[int, int, int, str] | None = None  # (fd, st_dev, st_ino, path): _check_local
        self._stop: threading.Event | None = None
        self._held = False

    @property
    def held(self) -> bool:
        return self._held

    @classmethod
    def inherited(cls, backend: Any, branch: str, fd: int) -> "BranchLock":
        """The local lock held through ``fd``: a descriptor of the holder's
        own open lock file, inherited across fork (a capture helper shares
        its trainer's flock, so the branch stays locked until both are gone)."""
        lock = cls(open_backend(backend), branch)
        lock._fd, lock._held = fd, True
        _HELD.add(lock)
        return lock

    def fileno(self) -> int | None:
        """The lock file's descriptor (local locks), else None."""
        return self._fd

    # ------------------------------------------------------------- local: flock

    def _files(self) -> LocalBackend:
        """The backend as the local store it is on this path (flock)."""
        return cast(LocalBackend, self.backend)

    def _acquire_local(self) -> bool:
        path = self._files()._path(self.key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        while True:
            # O_CLOEXEC: a program exec'ed by the writer must not keep the flock alive.
            fd = self._files()._open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK)
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a device node would get our record written into it
                os.close(fd)
                raise CorruptStoreError(f"refusing the lock file {path}: not a regular file (dstt stores hold only files)")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    return False
                raise
            # The file may have been removed (released or broken) between our
            # open and flock: then we locked an orphan inode; try again.
            try:
                same = _same_inode(fd, path)
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            self._fd = fd
            try:  # the record is only for messages: a full disk must not fail the lock
                os.ftruncate(fd, 0)
                os.pwrite(fd, _record(self.branch, self.token), 0)
            except OSError:
                pass
            return True

    def _check_local(self) -> str | None:
        fd = self._fd
        if fd is None:
            return "its lock file is closed"
        # The open file's identity and the lock file's path cannot change
        # while ``fd`` is ours: taken once (a capture checks before every
        # step, every few milliseconds in a fast loop: issue 16); the path's
        # file is looked up each time (a broken lock replaces or removes it).
        held = self._held_file
        if held is None or held[0] != fd:
            st = os.fstat(fd)
            held = self._held_file = (fd, st.st_dev, st.st_ino, self._files()._path(self.key))
        try:
            now = os.stat(held[3])
        except FileNotFoundError:
            return "its lock file was removed (the lock was broken)"
        if (now.st_dev, now.st_ino) != (held[1], held[2]):
            return "its lock file was replaced (the lock was broken)"
        return None

    def _release_local(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            path = self._files()._path(self.key)
            if _same_inode(fd, path):
                os.unlink(path)  # while still locked: waiters re-check the inode
        except OSError:
            pass
        finally:
            os.close(fd)

    # ------------------------------------------------------------- other: lease

    def _acquire_lease(self, ttl: float) -> bool:
        _check_atomic_create(self.backend)
        data = _record(self.branch, self.token, ttl)
        if not self.backend.put_if_absent(self.key, data):
            raw = self.backend.get(self.key, max_bytes=LOCK_RECORD_MAX_BYTES)
            info = LockInfo.parse(self.branch, raw)
            if info.expires is not None and info.expires > time.time() and not info.gone():
                return False  # (a lease whose holder died on this host is taken over like an expired one)
            if info.expires is None and self.backend.exists(self.key):
                # Unreadable lease: treat as held until its writer's ttl could
                # have passed; the caller can break it explicitly.
                return False
            # Expired: take over. Where the store can replace an object only
            # if it is unchanged, of two writers taking over the same lease one
            # wins; "delete, then create" lets the second delete the first's.
            replace = getattr(self.backend, "put_if_unchanged", None)
            if replace is not None and raw is not None:
                if not replace(self.key, raw, data):
                    return False
            else:
                self.backend.delete(self.key)
                if not self.backend.put_if_absent(self.key, data):
                    return False
        if LockInfo.parse(self.branch, self.backend.get(self.key, max_bytes=LOCK_RECORD_MAX_BYTES)).token != self.token:
            return False
        self._stop = threading.Event()
        t = threading.Thread(target=self._renew, args=(ttl, self._stop), name="dstt-lease", daemon=True)
        t.start()
        return True

    def _renew(self, ttl: float, stop: threading.Event) -> None:
        while not stop.wait(ttl / 3):
            try:
                raw = self.backend.get(self.key, max_bytes=LOCK_RECORD_MAX_BYTES)
                current = LockInfo.parse(self.branch, raw)
                if current.token != self.token:
                    return  # broken or taken over: stop renewing
                renewed = _record(self.branch, self.token, ttl)
                replace = getattr(self.backend, "put_if_unchanged", None)
                if replace is not None and raw is not None:
                    # Never over a lease taken over since it was read.
                    replace(self.key, raw, renewed)
                else:
                    self.backend.put(self.key, renewed)
            except Exception:  # pragma: no cover - retried at the next period
                continue

    def _check_lease(self) -> str | None:
        info = LockInfo.parse(self.branch, self.backend.get(self.key, max_bytes=LOCK_RECORD_MAX_BYTES))
        if info.token != self.token:
            return "its lease was removed or taken over (the lock was broken or expired)"
        if info.expires is not None and info.expires <= time.time():
            return "its lease expired (the writer was paused for longer than the lease ttl)"
        return None

    def _release_lease(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._stop = None
        with contextlib.suppress(Exception):
            if LockInfo.parse(self.branch, self.backend.get(self.key, max_bytes=LOCK_RECORD_MAX_BYTES)).token == self.token:
                self.backend.delete(self.key)

    # ------------------------------------------------------------- public

    def try_acquire(self, ttl: float = LEASE_TTL) -> bool:
        if self._held:
            return True
        try:  # every writer (save, Capture, branch, prune, gc) locks first: one place for this
            ok = self._acquire_local() if self.backend.flock else self._acquire_lease(ttl)
        except OSError as e:  # a read-only store: a clear error, not a raw OSError
            raise not_writable(self.backend.url, e) from None
        self._held = ok
        if ok:
            _HELD.add(self)
        return ok

    def check(self) -> None:
        """Raise StoreLockedError unless this lock is still held by us: the
        same lock file (local) or our unexpired lease (other backends).

        Writers call it before each step and right before each commit
        marker. (A holder stopped between this check and its commit can still
        commit once: breaking a live lock is refused without ``force``.)"""
        if not self._held:
            raise StoreLockedError(f"the write lock of branch {self.branch!r} of {self.backend.url} is not held")
        why = self._check_local() if self.backend.flock else self._check_lease()
        if why is not None:
            raise StoreLockedError(
                f"lost the write lock of branch {self.branch!r} of {self.backend.url}: {why}; "
                f"nothing more is committed by this writer (another writer may own the branch now)")

    def release(self) -> None:
        """Release the lock (idempotent)."""
        if not self._held:
            return
        self._held = False
        if self.backend.flock:
            self._release_local()
        else:
            self._release_lease()

    def holder(self) -> LockInfo:
        return LockInfo.parse(self.branch, self.backend.get(self.key, max_bytes=LOCK_RECORD_MAX_BYTES))

    def __enter__(self) -> "BranchLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()


def _check_atomic_create(backend: Backend) -> None:
    """Say at lock time when a store cannot make a lease safe: backends that
    can check their conditional create do (StoreLockedError when the store
    ignores it); others without ``atomic_create`` get a warning."""
    check = getattr(backend, "check_atomic_create", None)
    if check is not None:
        check()
    elif not backend.atomic_create:
        import warnings

        warnings.warn(f"{backend.url}: this store's conditional create is not atomic; two writers "
                      f"starting together could both take a branch lock (see docs/object-stores.md)",
                      StoreWarning, stacklevel=4)


def _same_inode(fd: int, path: str) -> bool:
    a = os.fstat(fd)
    b = os.stat(path)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def acquire(backend: Any, branch: str, *, timeout: float = 0.0, ttl: float = LEASE_TTL,
            renaming_ok: bool = False) -> BranchLock:
    """Take the write lock of ``branch``; StoreLockedError if another writer
    holds it after ``timeout`` seconds (0: do not wait). A branch an
    interrupted rename involves is refused (ConfigError naming the command
    that finishes it; :mod:`dstt.format.branchrename`) unless ``renaming_ok``
    (what gc, prune and the rename itself take, through :func:`acquire_all`)."""
    backend = open_backend(backend)
    if not renaming_ok and branch != BRANCH_SET:
        from dstt.format.renames import refuse_if_renaming

        refuse_if_renaming(backend, branch)
    lock = BranchLock(backend, branch)
    deadline = time.monotonic() + max(0.0, timeout)
    while not lock.try_acquire(ttl):
        if time.monotonic() >= deadline:
            raise _locked_error(backend, branch, lock.holder())
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
    return lock


def branch_set_lock(backend: Any, *, timeout: float = 2.0, patience: float = 60.0) -> BranchLock:
    """Take the lock of the store's branch set (see :data:`BRANCH_SET`).
    Creating a branch holds it for a few requests, a prune or gc for as
    long as they run. Branch creations racing each other queue up: on an
    object store each holds it for a fraction of a second, so the wait
    fails (StoreLockedError saying who holds it) only once one holder has
    held it for ``timeout`` s, or after ``patience`` s in all."""
    backend = open_backend(backend)
    lock = BranchLock(backend, BRANCH_SET)
    start = time.monotonic()
    holding: tuple[Any, ...] | None = None
    since = start
    while not lock.try_acquire():
        now = time.monotonic()
        info = lock.holder()
        if (info.token, info.pid, info.since) != holding:  # another holder: the queue moves
            holding, since = (info.token, info.pid, info.since), now
        if now - since >= timeout or now - start >= patience:
            raise _locked_error(backend, BRANCH_SET, info)
        time.sleep(min(0.05, max(0.0, timeout - (now - since))))
    return lock


def lock_holder(backend: Any, branch: str) -> LockInfo | None:
    """Who holds ``branch``'s lock now, or None when it is free."""
    backend = open_backend(backend)
    probe = BranchLock(backend, branch)
    if backend.flock:
        if not backend.exists(probe.key):
            return None
        if probe.try_acquire():
            probe.release()
            return None
        return probe.holder()
    info = LockInfo.parse(branch, backend.get(probe.key, max_bytes=LOCK_RECORD_MAX_BYTES)) if backend.exists(probe.key) else None
    if info is not None and ((info.expires is not None and info.expires <= time.time()) or info.gone()):
        return None  # expired, or its holder died on this host: stale
    return info


def break_lock(backend: Any, branch: str, *, force: bool = False) -> LockInfo | None:
    """Remove ``branch``'s lock; the previous holder's record (None if there
    was no lock file). A lock whose holder is provably alive (a held
    ``flock``; an unexpired lease) is refused with StoreLockedError unless
    ``force``: that holder would go on writing chunks of its current step
    into the slot the next writer uses (it only fails at its next lock
    check, before its commit).

    >>> import tempfile
    >>> from dstt.format.backends import LocalBackend
    >>> b = LocalBackend(tempfile.mkdtemp())
    >>> held = acquire(b, "main")
    >>> try:
    ...     break_lock(b, "main")
    ... except StoreLockedError:
    ...     print("refused: the holder is alive")
    refused: the holder is alive
    >>> break_lock(b, "main", force=True).pid == os.getpid()
    True
    >>> held.check()
    Traceback (most recent call last):
    dstt.errors.StoreLockedError: lost the write lock of branch 'main' ...
    >>> acquire(b, "main").release()
    """
    force = A.flag("force", force)
    backend = open_backend(backend)
    key = L.lock_key(A.branch(branch))
    if not backend.exists(key):
        return None
    live = lock_holder(backend, branch)
    if live is not None and not force:
        raise StoreLockedError(
            f"branch {branch!r} of {backend.url} is locked by a live writer ({live.describe()}); "
            f"refusing to break its lock (stop that writer, or force it knowing it may overwrite "
            f"the next writer's uncommitted chunks before it notices)")
    info = LockInfo.parse(branch, backend.get(key, max_bytes=LOCK_RECORD_MAX_BYTES))
    backend.delete(key)
    return info


def branches_of(backend: Backend) -> list[str]:
    return L.branch_names(backend.list_dir(L.BRANCHES_DIR))


@contextlib.contextmanager
def acquire_all(backend: Any, branches: list[str] | None = None, *, timeout: float = 0.0) -> Iterator[list[BranchLock]]:
    """Hold the write locks of ``branches`` (default: every branch) for the
    duration of a ``with`` block -- what gc/prune take so no writer runs
    meanwhile; with no explicit ``branches`` the branch-set lock is taken
    first, so the list cannot grow meanwhile either. Locks are taken in
    sorted order; on failure every lock taken so far is released and
    StoreLockedError names the busy branch.

    >>> import tempfile
    >>> from dstt.format.backends import LocalBackend
    >>> b = LocalBackend(tempfile.mkdtemp())
    >>> with acquire_all(b, ["a", "main"]) as locks:
    ...     len(locks)
    2
    """
    backend = open_backend(backend)
    held: list[BranchLock] = []
    try:
        if branches is None:
            held.append(acquire(backend, BRANCH_SET, timeout=timeout))
        for name in sorted(set(branches if branches is not None else branches_of(backend))):
            held.append(acquire(backend, name, timeout=timeout, renaming_ok=True))
        yield held
    finally:
        for lock in reversed(held):
            lock.release()


#: Locks held by this process; a forked child forgets them (below).
_HELD: "weakref.WeakSet[BranchLock]" = weakref.WeakSet()


def _forget_in_child() -> None:
    """After os.fork(), in the child: the child inherited the lock file's
    descriptor (one open file description with the parent's flock) but not
    the lock. Close the child's copy -- that never unlocks the parent, while
    keeping it would hold the branch locked after the parent died -- and
    mark the lock not held, so the child's release() (or garbage
    collection) neither unlinks the parent's lock file nor deletes its lease."""
    for lock in list(_HELD):
        fd, lock._fd = lock._fd, None
        lock._held = False
        lock._stop = None  # the renewing thread stayed in the parent
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


__all__ = ["BranchLock", "LockInfo", "acquire", "acquire_all", "branch_set_lock", "break_lock", "lock_holder",
           "BRANCH_SET", "LEASE_TTL"]
