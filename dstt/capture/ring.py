"""The staging ring in /dev/shm: pool files and sealed step records that
outlive the trainer.

Layout (one directory per Capture, mode 0700, under the user's own root)::

    /dev/shm/dstt-<uid>/<group>/<run>/owner.json        who, for which store and branch
                                     /pool-<gen>.bin    the staging pool (mmap'ed)
                                     /seal-<step>.json  one sealed step

``<group>`` hashes the store's URL and the branch; ``owner.json`` also names
the branch id and its creation time, so a ring is never applied to another
store or to a branch recreated under the same name.

A step is *sealed* once every copy of it has landed in the pool: its record
(step, the plan's layouts and value tree, each chunk's place in the pool
file: seals.py) is written with an atomic rename. The pool blocks of a
sealed step are not reused until its record is removed (the step is
committed) or rewritten with CRC-32Cs covering every chunk's bytes (it was
not: capture/crashsafe.py). So if the trainer dies, each record left names
bytes that are still in the pool file, or CRCs that tell whether they
are, and the next Capture on that store and branch (which holds the
branch lock, so no other writer owns those rings) commits them in step
order (:func:`recover`), checking every CRC first and skipping a step
whose bytes changed; a ring that does not check out is discarded whole.

Why files and not ``multiprocessing.shared_memory``: its resource tracker
unlinks segments when the process that made them exits, which is exactly
the moment they are needed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import mmap
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dstt.capture.seals import SEAL_FORMAT as SEAL_FORMAT  # the ring's records (seals.py), used as ring.X too
from dstt.capture.seals import CorruptRing as CorruptRing
from dstt.capture.seals import StaleSeal as StaleSeal
from dstt.capture.seals import encode_record as encode_record
from dstt.capture.seals import plan_of as plan_of
from dstt.capture.seals import read_record as read_record
from dstt.capture.seals import seal_record as seal_record
from dstt.errors import CaptureError
from dstt.store.localio import pid_alive

log = logging.getLogger("dstt.capture")

SHM_ROOT = Path("/dev/shm")
#: A seal record is a few KB per hundred tensors; anything bigger is not ours.
SEAL_MAX_BYTES = 256 << 20


def ring_root(base: Path | None = None) -> Path:
    return (base or SHM_ROOT) / f"dstt-{os.getuid()}"


def shm_free_bytes(base: Path | None = None) -> int | None:
    """Free bytes of /dev/shm, or None where there is none."""
    base = base or SHM_ROOT
    try:
        st = os.statvfs(base)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def group_dir(store_url: str, branch: str, base: Path | None = None, rank: int | None = None) -> Path:
    """The directory of the rings of a store's branch (of one rank of a
    distributed Capture: each rank's rings apart, so one rank's recovery
    never judges another rank's ring)."""
    text = f"{store_url}\0{branch}" + ("" if rank is None else f"\0rank{rank}")
    return ring_root(base) / hashlib.sha256(text.encode()).hexdigest()[:24]


def group_of(identity: dict[str, Any], base: Path | None = None) -> Path:
    return group_dir(identity["store"], identity["branch"], base, identity.get("rank"))


def _private_dir(path: Path) -> None:
    """Create ``path`` (and parents) as 0700 and check it is ours: a ring
    read back is trusted only if nobody else could have written it."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not path.is_dir() or path.is_symlink() or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise CaptureError(f"{path}: not a private directory of this user; refusing to stage there")


class Ring:
    """This Capture's ring directory: pool files and seal records.

    >>> import tempfile
    >>> r = Ring({"store": "s", "branch": "main", "branch_id": 0, "branch_created": 0.0},
    ...          base=Path(tempfile.mkdtemp()))
    >>> buf = r.new_pool(1 << 16)
    >>> buf.numel(), r.pool_name
    (65536, 'pool-0.bin')
    >>> r.close()
    """

    #: Injection point for tests and tools: called as ``before_op(op, path)``
    #: before each file operation this process makes on the ring --
    #: ``"pool"`` (create and reserve a pool file), ``"seal"`` (write a
    #: seal's temporary file), ``"rename"`` (publish it), ``"unseal"``
    #: (remove a seal), ``"drop"`` (remove an old pool file). An OSError it
    #: raises is that operation's failure (EIO, ENOSPC... as the kernel
    #: would report them). Set it on a Ring (``cap._ring.before_op = f``).
    before_op: Callable[[str, str], None] | None = None

    def __init__(self, identity: dict[str, Any], base: Path | None = None, run: str | None = None) -> None:
        self.identity = dict(identity)
        self.group = group_of(identity, base)
        _private_dir(ring_root(base))
        sweep(base)
        _private_dir(self.group)
        self.dir = self.group / f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        _private_dir(self.dir)
        self._dir_text = os.fspath(self.dir)
        # ``run`` (a distributed Capture's id, ranks.py) is not identity: a
        # ring of an earlier run of the same store and branch is recovered.
        owner = {**self.identity, "pid": os.getpid(), **({"run": run} if run else {})}
        _write_atomic(self.dir / "owner.json", json.dumps(owner).encode())
        self._gen = -1
        self.pool_name = ""
        self._maps: dict[str, mmap.mmap] = {}

    def new_pool(self, capacity_bytes: int) -> torch.Tensor:
        """A fresh pool file of ``capacity_bytes`` mapped shared, every page
        of it reserved now (``posix_fallocate``): a sparse file would be
        backed page by page at the first copy into each, and /dev/shm
        filling up meanwhile killed the trainer with SIGBUS at that copy
        (issue 23). RingError (ENOSPC...) if it cannot be: the caller
        stages elsewhere."""
        self._gen += 1
        name = f"pool-{self._gen}.bin"
        path = os.fspath(self.dir / name)
        try:
            if self.before_op is not None:
                self.before_op("pool", path)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise RingError("creating the staging pool", path, e) from None
        try:
            reserve = getattr(os, "posix_fallocate", None)
            if reserve is not None:
                reserve(fd, 0, capacity_bytes)
            else:  # (no posix_fallocate on this platform: sparse, as before)
                os.ftruncate(fd, capacity_bytes)
            mm = mmap.mmap(fd, capacity_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            with _suppress():
                os.unlink(path)  # (its pages go with it)
            raise RingError(f"reserving {capacity_bytes} bytes for the staging pool", path, e) from None
        finally:
            os.close(fd)
        self._maps[name] = mm
        self.pool_name = name
        return torch.frombuffer(mm, dtype=torch.uint8)

    def drop_pool(self, name: str) -> None:
        """Forget an old pool file (no sealed step refers to it any more)."""
        self._maps.pop(name, None)  # the mapping goes when its last tensor view does
        with _suppress():
            if self.before_op is not None:
                self.before_op("drop", os.fspath(self.dir / name))
            os.unlink(self.dir / name)

    def seal(self, record: dict[str, Any]) -> None:
        """Write a step's seal record (atomically: a seal is whole or absent);
        RingError, naming the seal, its path and errno, if it cannot be."""
        step = record["step"]
        path = f"{self._dir_text}/seal-{step:020d}.json"  # (no pathlib: a seal per step of a fast loop)
        try:
            _write_atomic(path, encode_record(record), self.before_op)
        except OSError as e:
            raise RingError(f"writing the seal of step {step}", path, e) from None

    def unseal(self, step: int, strict: bool = False) -> None:
        """Remove ``step``'s seal; ``strict``: a failure other than its
        absence is raised as RingError (the caller must know it is gone:
        capture/keeper.py decides what may then be reused)."""
        path = f"{self._dir_text}/seal-{step:020d}.json"
        if not strict:
            with _suppress():
                if self.before_op is not None:
                    self.before_op("unseal", path)
                os.unlink(path)
            return
        try:
            if self.before_op is not None:
                self.before_op("unseal", path)
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise RingError(f"removing the seal of step {step}", path, e) from None

    def close(self) -> None:
        """Remove the ring (everything in it is committed or given up)."""
        self._maps.clear()
        remove_ring(self.dir)


def sweep(base: Path | None = None) -> int:
    """Remove rings that can never be committed, of any store: their owner
    is dead and they hold no seal record, or the local store they belong to
    is gone. (A ring with seals of a live store waits for the next Capture
    on its branch.) The number removed."""
    removed = 0
    try:
        groups = list(ring_root(base).iterdir())
    except OSError:
        return 0
    for group in groups:
        for ring in list(group.iterdir()) if group.is_dir() and not group.is_symlink() else []:
            try:
                owner = json.loads(read_bounded(ring / "owner.json"))
                pid, store = int(owner["pid"]), str(owner["store"])
            except (OSError, ValueError, KeyError, TypeError, CorruptRing):
                continue  # being created, or not ours to judge
            if pid_alive(pid):
                continue
            local_gone = store.startswith("/") and not os.path.exists(store)
            if local_gone or not any(ring.glob("seal-*.json")):
                remove_ring(ring)
                removed += 1
        with _suppress():
            group.rmdir()  # empty: every ring of that store and branch is gone
    return removed



def unseal_file(ring: Path, step: int) -> None:
    with _suppress():
        os.unlink(ring / f"seal-{step:020d}.json")


def sealed_steps(ring: Path) -> list[int]:
    """Steps with a seal record in ``ring``, in order."""
    out = []
    for p in ring.glob("seal-*.json"):
        digits = p.name[5:-5]
        if digits.isdigit():
            out.append(int(digits))
    return sorted(out)


def remove_ring(ring: Path) -> None:
    shutil.rmtree(ring, ignore_errors=True)
    with _suppress():
        ring.parent.rmdir()  # when no other ring of this store and branch is left


class RingError(OSError):
    """A file operation on the staging ring failed: which one, on which
    file, the errno, and what to do about it (:func:`ring_advice`).

    >>> import errno
    >>> print(RingError("writing the seal of step 3", "/dev/shm/x/seal-3.json", OSError(errno.ENOSPC, "No space left on device")))
    writing the seal of step 3 (/dev/shm/x/seal-3.json) failed: [Errno 28] No space left on device; /dev/shm is full ...
    """

    def __init__(self, what: str, path: str, cause: OSError) -> None:
        super().__init__(cause.errno, cause.strerror or str(cause), path)
        self.what = what

    @property
    def brief(self) -> str:
        """What failed, where and the errno, without the advice."""
        return f"{self.what} ({self.filename}) failed: [Errno {self.errno}] {self.strerror}"

    def __str__(self) -> str:
        return f"{self.brief}; {ring_advice(self.errno)}"


def ring_advice(code: int | None) -> str:
    """What to do when a file operation on the staging ring fails with ``code``."""
    shm = os.fspath(SHM_ROOT)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return (f"{shm} is full (the staging ring lives there): free space in it or make it larger (Docker: "
                "--shm-size), or pass shm=False to stage in process memory (steps then do not survive the trainer)")
    if code == errno.ENOENT:
        return ("the staging ring's directory was removed under the running Capture (something cleans "
                f"{shm}: e.g. systemd-logind with RemoveIPC=yes when the user logs out, a tmpfiles rule, a "
                "script): stop it, or pass shm=False")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"this process may no longer write under {shm}: check its mount and the ring's owner, or pass shm=False"
    return f"the filesystem of {shm} refused it (see the kernel log); shm=False stages in process memory instead"


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], OSError)


def _write_atomic(path: Path | str, data: bytes, before_op: Callable[[str, str], None] | None = None) -> None:
    tmp = f"{os.fspath(path)}.tmp"
    if before_op is not None:
        before_op("seal", tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:  # a short write (the filesystem filling up) is not the whole record
            view = view[os.write(fd, view):]
    except BaseException:
        with _suppress():
            os.unlink(tmp)
        raise
    finally:
        os.close(fd)
    try:
        if before_op is not None:
            before_op("rename", os.fspath(path))
        os.replace(tmp, path)
    except BaseException:
        with _suppress():
            os.unlink(tmp)
        raise


# ----------------------------------------------------------------------------- recovery


def abandoned(identity: dict[str, Any], base: Path | None = None, exclude: Path | None = None
              ) -> list[tuple[Path, list[dict[str, Any]]]]:
    """Rings of this store and branch other than ``exclude``, each with its
    seal records in step order. Rings of another store or of an earlier
    branch of the same name are removed. The caller holds the branch lock,
    so every other ring's owner is gone (or closed)."""
    group = group_of(identity, base)
    out = []
    try:
        entries = sorted(group.iterdir())
    except OSError:
        return []
    for ring in entries:
        if ring == exclude or not ring.is_dir() or ring.is_symlink():
            continue
        try:
            if os.lstat(ring).st_uid != os.getuid():
                continue
            owner = json.loads(read_bounded(ring / "owner.json"))
            if not isinstance(owner, dict) or any(owner.get(k) != v for k, v in identity.items()):
                raise CorruptRing("another store or branch")
            seals = []
            for p in sorted(ring.glob("seal-*.json")):
                try:
                    doc = read_record(read_bounded(p))
                except CorruptRing as e:
                    raise CorruptRing(f"{p.name}: {e}") from None
                seals.append(doc)
        except (OSError, ValueError, CorruptRing) as e:
            log.warning("dstt: discarding staging ring %s: %s", ring, e)
            shutil.rmtree(ring, ignore_errors=True)
            continue
        out.append((ring, sorted(seals, key=lambda d: d["step"])))
    return out


def map_pool(ring: Path, name: str) -> torch.Tensor:
    if "/" in name or not name.startswith("pool-"):
        raise CorruptRing(f"bad pool name {name!r}")
    fd = os.open(ring / name, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE) if size else None
    finally:
        os.close(fd)
    if mm is None:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mm, dtype=torch.uint8)


def read_bounded(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        import stat

        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptRing(f"{path.name}: not a regular file")
        chunks, size = [], 0
        while size <= SEAL_MAX_BYTES:
            part = os.read(fd, SEAL_MAX_BYTES + 1 - size)
            if not part:
                break
            chunks.append(part)
            size += len(part)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > SEAL_MAX_BYTES:
        raise CorruptRing(f"{path.name}: larger than {SEAL_MAX_BYTES} bytes")
    return data


def recover(writer: Any, identity: dict[str, Any], *, exclude: Path | None = None, base: Path | None = None
            ) -> list[int]:
    """Commit, in step order, the sealed steps of this branch's abandoned
    rings that are newer than its last commit; remove those rings. The
    steps committed. ``writer`` (a :class:`~dstt.store.writer.Writer` of a
    single process) holds the branch lock."""
    done: list[int] = []
    for ring, seals in abandoned(identity, base, exclude):
        maps: dict[str, torch.Tensor] = {}
        try:
            for record in seals:
                step = record.get("step")
                if not isinstance(step, int) or (writer.last_step is not None and step <= writer.last_step and (
                        step == writer.last_step or writer.is_stored(step))):
                    continue  # committed before the trainer died (an older one not stored is a backfill: Writer.adopt)
                pool = maps.get(record["pool"])
                if pool is None:
                    pool = maps[record["pool"]] = map_pool(ring, record["pool"])
                try:
                    plan = writer.adopt(plan_of(record, pool))
                except StaleSeal as e:
                    log.warning("dstt: not committing a step of staging ring %s: %s", ring, e)
                    continue
                writer.ensure_arrays(plan)
                results, error = writer.flush_chunks(plan, plan.tasks)  # (store/batchflush.py)
                if error is not None:
                    raise error
                writer.commit(plan, results)
                done.append(step)
                log.warning("dstt: committed step %d of branch %r, sealed in the staging ring of a trainer that "
                            "died (%s)", step, identity["branch"], ring.name)
        except (CorruptRing, KeyError, TypeError, ValueError) as e:
            log.warning("dstt: discarding the rest of staging ring %s: %s", ring, e)
        finally:  # a store error propagates and keeps the ring for the next try
            maps.clear()
        shutil.rmtree(ring, ignore_errors=True)
    return done
