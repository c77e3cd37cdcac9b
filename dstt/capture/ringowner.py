"""Who owns a staging ring, proven (issue 23): a ring is deleted, adopted
or set aside only once its owner is proven gone, and a directory that is
not this user's own is never used.

**Liveness by a lock, not by a pid.** A ring's owner (the trainer's
:class:`~dstt.capture.ring.Ring`, and its capture helper) holds a shared
``flock`` on the ring's ``owner.lock`` for as long as it lives; the kernel
drops it when the last process holding it dies, whatever PID namespace it
runs in (a container started with ``--ipc=host`` shares ``/dev/shm`` but
not its pids: judged by pid, its live ring was taken for a dead one and
deleted). Whoever wants to delete, adopt or set aside a ring first takes
that lock exclusively (:func:`claim`) and holds it while it does: only then
is the owner proven gone, and no two processes act on one ring. The lock
file is created locked, under a temporary name, and renamed into place, so
an owner's ring is never seen unlocked while it lives.

**Identity as a second opinion.** ``owner.json`` also names the owner's
process: pid, start time, boot id and PID namespace (:func:`process_identity`).
A ring whose lock is free but whose owner, by that identity, still runs in
this PID namespace (its lock descriptor closed by accident) is not claimed.
An owner that gives its ring up alive (its helper died: the sealed steps
wait for the next Capture) renames the lock file to ``owner.released``
before closing it (:func:`release`).

**Not proven, not touched.** A ring without a lock file (being created, or
left by a dstt older than this) is never deleted, adopted or set aside.

**Ours or nothing.** The ring root ``/dev/shm/dstt-<uid>`` and every
directory under it must be a real directory (no symlink) of this user with
no access for others (:func:`private`): one that is not is never read nor
written (:func:`root_problem` says why, so the Capture stages in process
memory instead, with a warning).

**Set aside, never deleted.** A ring whose records do not check out is
renamed into ``<root>/set-aside/`` (never trusted, never adopted) with one
:class:`StagingRingWarning` naming it (:func:`set_aside`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import stat
import time
import warnings
from pathlib import Path
from typing import Any

from dstt import knobs
from dstt.errors import StagingRingWarning

log = logging.getLogger("dstt.capture")

SHM_ROOT = Path("/dev/shm")
#: Where rings live instead of /dev/shm (a directory holding ``dstt-<uid>``):
#: for tests and for machines whose shared memory is mounted elsewhere
#: (read through :func:`dstt.knobs.shm_dir`).
SHM_ENV = "DSTT_SHM_DIR"
OWNER_FILE = "owner.json"
LOCK_FILE = "owner.lock"
RELEASED_FILE = "owner.released"
SET_ASIDE_DIR = "set-aside"
#: owner.json is ~500 bytes; anything bigger is not ours.
OWNER_MAX_BYTES = 1 << 16
#: Names dstt gives: a group (hash of store and branch) and a ring (pid, id).
GROUP_RE = re.compile(r"[0-9a-f]{24}")
RING_RE = re.compile(r"[0-9]{1,10}-[0-9a-f]{12}")


#: Lock descriptors this process holds (closed in a forked child: see _forget_in_child).
_HELD: set[int] = set()


def shm_base(base: Path | None = None) -> Path:
    """The directory holding ``dstt-<uid>``: ``base``, else $DSTT_SHM_DIR, else /dev/shm."""
    if base is not None:
        return base
    return knobs.shm_dir() or SHM_ROOT


def ring_root(base: Path | None = None) -> Path:
    return shm_base(base) / f"dstt-{os.getuid()}"


def group_dir(store_url: str, branch: str, base: Path | None = None, rank: int | None = None) -> Path:
    """The directory of the rings of a store's branch (of one rank of a
    distributed Capture: each rank's rings apart, so one rank's recovery
    never judges another rank's ring)."""
    text = f"{store_url}\0{branch}" + ("" if rank is None else f"\0rank{rank}")
    return ring_root(base) / hashlib.sha256(text.encode()).hexdigest()[:24]

# ----------------------------------------------------------------------------- ownership of directories


def private(path: Path) -> bool:
    """Whether ``path`` is a directory (not a symlink) of this user that no
    other user can enter or write."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def dir_problem(path: Path) -> str | None:
    """Why ``path`` is not a private directory of this user; None if it
    is, or does not exist (then it is made, private)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.getuid():
        return f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    if st.st_mode & 0o077:
        return f"{path} has mode {stat.S_IMODE(st.st_mode):o}: other users could write into it"
    return None


def root_problem(base: Path | None = None) -> str | None:
    """Why this user's ring root cannot be used (another user made it, it
    is a symlink or a file, others may write into it); None if it can.

    >>> import tempfile
    >>> root_problem(Path(tempfile.mkdtemp())) is None
    True
    """
    return dir_problem(ring_root(base))


def make_private(path: Path) -> None:
    """Create ``path`` (mode 0700) unless it exists; OSError if it is not a
    private directory of this user then (it is never used)."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    problem = dir_problem(path)
    if problem is not None or not path.is_dir():
        raise PermissionError(problem or f"{path}: not a directory")


def groups(base: Path | None = None) -> list[Path]:
    """The group directories of this user's ring root (nothing if the root is not private)."""
    root = ring_root(base)
    if not private(root):
        return []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    return [root / n for n in names if GROUP_RE.fullmatch(n) and private(root / n)]


def rings_in(group: Path) -> list[Path]:
    """The ring directories of a group directory (private ones only)."""
    if not private(group):
        return []
    try:
        names = sorted(os.listdir(group))
    except OSError:
        return []
    return [group / n for n in names if RING_RE.fullmatch(n) and private(group / n)]


# ----------------------------------------------------------------------------- process identity


def _read_small(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(4096).decode("ascii", "replace").strip()
    except OSError:
        return None


def _start_ticks(pid: int | str) -> tuple[int, bool] | None:
    """(start time in clock ticks after boot, zombie) of process ``pid`` as
    this PID namespace sees it; None if there is none."""
    text = _read_small(f"/proc/{pid}/stat")
    if not text:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    try:
        return int(fields[19]), fields[0] == "Z"
    except (IndexError, ValueError):
        return None


def _namespace(kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return None


def process_identity(pid: int | None = None) -> dict[str, Any]:
    """This process (or process ``pid`` as this one sees it: same boot and
    namespaces): pid, start time, boot id, PID and mount namespaces (None
    where /proc does not say)."""
    got = _start_ticks("self" if pid is None else pid)
    return {"pid": os.getpid() if pid is None else pid, "start": got[0] if got else None,
            "boot": _read_small("/proc/sys/kernel/random/boot_id"),
            "pidns": _namespace("pid"), "mntns": _namespace("mnt")}


def same_namespace(proc: Any, kind: str) -> bool:
    """Whether the process ``proc`` (an identity) ran in this process's
    ``kind`` namespace ("pidns", "mntns") of this boot."""
    if not isinstance(proc, dict):
        return False
    me = process_identity()
    return me["boot"] is not None and proc.get("boot") == me["boot"] and \
        me[kind] is not None and proc.get(kind) == me[kind]


def identity_alive(proc: Any) -> bool:
    """Whether the process ``proc`` describes still runs, as far as this
    process can see (same boot and PID namespace, that pid with that start
    time, not a zombie). False when it cannot tell."""
    if not same_namespace(proc, "pidns"):
        return False
    pid, start = proc.get("pid"), proc.get("start")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or not isinstance(start, int):
        return False
    got = _start_ticks(pid)
    return got is not None and got[0] == start and not got[1]


# ----------------------------------------------------------------------------- the owner's lock


def take_ownership(ring: Path, owner: dict[str, Any]) -> int:
    """Make this process the owner of the new ring directory ``ring``:
    ``owner.lock`` locked (shared) before it gets its name, then
    ``owner.json`` (``owner`` and this process's identity). The lock's
    descriptor, held until :func:`release` or :func:`drop` (or death)."""
    tmp = ring / (LOCK_FILE + ".tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        os.replace(tmp, ring / LOCK_FILE)
        doc = {**owner, "pid": os.getpid(), "process": process_identity(), "lock": LOCK_FILE}
        write_atomic(ring / OWNER_FILE, json.dumps(doc).encode())
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _HELD.add(fd)
    return fd


def hold(ring: Path) -> int | None:
    """Share the ownership of ``ring`` (the capture helper, while it works
    on its trainer's ring): a shared lock on its ``owner.lock``, held for
    this process's life. None if it cannot be taken (then the ring counts
    as its trainer's alone)."""
    try:
        fd = os.open(ring / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    _HELD.add(fd)
    return fd


def release(ring: Path, fd: int | None) -> None:
    """Give ``ring`` up without removing it (its sealed steps are for the
    next Capture), although this process lives on: marked released, then unlocked."""
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.rename(ring / LOCK_FILE, ring / RELEASED_FILE)
    drop(fd)


def drop(fd: int | None) -> None:
    """Close a lock descriptor of :func:`take_ownership`, :func:`hold` or a claim."""
    if fd is None:
        return
    _HELD.discard(fd)
    with contextlib.suppress(OSError):
        os.close(fd)


def _forget_in_child() -> None:
    """After os.fork(), in the child: close its copies of the ring locks
    (that never unlocks the parent's; kept, they would keep a dead parent's
    ring looking alive as long as the child lives)."""
    for fd in list(_HELD):
        drop(fd)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class Claim:
    """An exclusive hold on a ring whose owner is proven gone (:func:`claim`):
    :attr:`owner` is its owner.json (None if unreadable). Release it with
    :meth:`close` (or :meth:`remove` / :func:`set_aside`, which do)."""

    def __init__(self, ring: Path, fd: int, owner: dict[str, Any] | None, why: str = "") -> None:
        self.ring, self.fd, self.owner, self.why = ring, fd, owner, why

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            drop(fd)

    def remove(self) -> None:
        """Delete the ring (what it holds can never be committed), then let go."""
        try:
            remove_tree(self.ring)
        finally:
            self.close()

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def claim(ring: Path, tries: int = 1) -> Claim | None:
    """Hold ``ring`` exclusively if its owner is proven gone; None while it
    may live (its lock is held, or by its identity it still runs here), or
    when it cannot be proven (no lock file: being created, or left by an
    older dstt), or the ring is not a private directory of this user.
    ``tries``: looks, 20 ms apart, while its lock is held (another process
    sweeping holds it a moment; an owner, all along)."""
    if not private(ring):
        return None
    fd = _open_lock(ring)
    if fd is None:
        return None
    for attempt in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError:  # held: its owner (or its helper) lives -- or flock does not work here
            if attempt + 1 == tries:
                os.close(fd)
                return None
            time.sleep(0.02)
    _HELD.add(fd)
    released = not os.path.exists(ring / LOCK_FILE) and os.path.exists(ring / RELEASED_FILE)
    owner, why = _read_owner(ring)
    if owner is not None and not released and identity_alive(owner.get("process")):
        drop(fd)  # its lock is gone but it runs: not proven
        return None
    return Claim(ring, fd, owner, why)


def probe(ring: Path) -> dict[str, Any] | None:
    """owner.json of ``ring`` if its owner is proven gone (claimed and let
    go at once: read-only callers); None otherwise or if unreadable."""
    c = claim(ring)
    if c is None:
        return None
    c.close()
    return c.owner


def _open_lock(ring: Path) -> int | None:
    for name in (LOCK_FILE, RELEASED_FILE):
        try:
            fd = os.open(ring / name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
        except OSError:
            st = None
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            return fd
        os.close(fd)
        return None
    return None


def _read_owner(ring: Path) -> tuple[dict[str, Any] | None, str]:
    """(owner.json of ``ring``, "") or (None, why it is unreadable)."""
    try:
        data = read_regular(ring / OWNER_FILE, OWNER_MAX_BYTES)
        doc = json.loads(data)
    except (OSError, ValueError, RecursionError) as e:
        return None, f"{OWNER_FILE}: {e}"
    if not isinstance(doc, dict):
        return None, f"{OWNER_FILE}: not an object"
    return doc, ""


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of ``path`` if it is a regular file of this user (no
    symlink followed, no FIFO opened for long) and at most ``limit`` bytes;
    OSError otherwise (ValueError if larger)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path.name}: not a regular file")
        if st.st_uid != os.getuid():
            raise ValueError(f"{path.name}: belongs to uid {st.st_uid}")
        chunks, size = [], 0
        while size <= limit:
            part = os.read(fd, limit + 1 - size)
            if not part:
                break
            chunks.append(part)
            size += len(part)
    finally:
        os.close(fd)
    if size > limit:
        raise ValueError(f"{path.name}: larger than {limit} bytes")
    return b"".join(chunks)


# ----------------------------------------------------------------------------- removing and setting aside


def remove_tree(ring: Path) -> None:
    """Delete a ring directory (never following a link), then its group if empty."""
    import shutil

    shutil.rmtree(ring, ignore_errors=True)
    with contextlib.suppress(OSError):
        ring.parent.rmdir()  # when no other ring of this store and branch is left


def set_aside(c: Claim, why: str) -> Path | None:
    """Rename the claimed ring into ``<root>/set-aside/`` (never trusted,
    never adopted, never deleted by dstt: kept to be looked at) and warn
    once, naming it and why; then let go. Where it now is (None if it could
    not be moved: it stays where it was, claimed by the next look again)."""
    ring = c.ring
    root = ring.parent.parent
    dest: Path | None = root / SET_ASIDE_DIR / f"{ring.parent.name}-{ring.name}-{int(time.time())}"
    try:
        make_private(root / SET_ASIDE_DIR)
        assert dest is not None
        os.rename(ring, dest)
        with contextlib.suppress(OSError):
            ring.parent.rmdir()
    except OSError as e:
        log.error("dstt: could not set staging ring %s aside (%s)", ring, e)
        dest = None
    finally:
        c.close()
    where = f"set aside as {dest}" if dest is not None else "left where it is"
    warnings.warn(f"dstt: staging ring {ring} does not check out ({why}): nothing of it is committed; {where} "
                  "(inspect it, then remove it by hand)", StagingRingWarning, stacklevel=2)
    return dest


def write_atomic(path: Path | str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    tmp = f"{os.fspath(path)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.replace(tmp, path)
