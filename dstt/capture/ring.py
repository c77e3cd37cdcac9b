"""The staging ring in /dev/shm: pool files and sealed step records that
outlive the trainer.

Layout (one directory per Capture, mode 0700, under the user's own root)::

    /dev/shm/dstt-<uid>/<group>/<run>/owner.json        who, for which store and branch
                                     /pool-<gen>.bin    the staging pool (mmap'ed)
                                     /seal-<step>.json  one sealed step

``<group>`` hashes the store's URL and the branch; ``owner.json`` also names
the branch id and its creation time, so a ring is never applied to another
store or to a branch recreated under the same name. Its owner holds a lock
on ``owner.lock`` for its life: a ring is deleted, adopted or set aside
only once that lock proves its owner gone, whatever PID namespace it ran
in, and a root or ring directory that is not this user's own is never used
(ringowner.py). A ring whose records do not check out (sealcheck.py) is set
aside whole, renamed, never deleted, with a warning.

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

import logging
import mmap
import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dstt.capture import ringowner as O
from dstt.capture.reserve import Reservation
from dstt.capture.ringerror import RingError as RingError  # (defined there; ring.RingError to its users)
from dstt.capture.ringerror import ring_advice as ring_advice
from dstt.capture.ringowner import SHM_ROOT as SHM_ROOT
from dstt.capture.ringowner import group_dir as group_dir  # (defined there: torch-free, for gc's check)
from dstt.capture.ringowner import ring_root as ring_root
from dstt.capture.sealcheck import check_record
from dstt.capture.sealplan import plan_of as plan_of
from dstt.capture.seals import SEAL_FORMAT as SEAL_FORMAT  # the ring's records (seals.py), used as ring.X too
from dstt.capture.seals import SEAL_VERSION as SEAL_VERSION
from dstt.capture.seals import CorruptRing as CorruptRing
from dstt.capture.seals import StaleSeal as StaleSeal
from dstt.capture.seals import encode_record as encode_record
from dstt.capture.seals import read_record as read_record
from dstt.capture.seals import seal_record as seal_record
from dstt.errors import CaptureError, DsttError, StepExistsError, StepOrderError

log = logging.getLogger("dstt.capture")

#: A seal record is a few KB per hundred tensors; anything bigger is not ours.
SEAL_MAX_BYTES = 256 << 20
_SEAL_RE = re.compile(r"seal-([0-9]{20})\.json")
_POOL_RE = re.compile(r"pool-[0-9]{1,9}\.bin")


class RingUnavailable(CaptureError):
    """This user's ring root (or a ring directory) cannot be used: the
    Capture stages in process memory instead (crashsafe.py)."""


def shm_free_bytes(base: Path | None = None) -> int | None:
    """Free bytes of /dev/shm, or None where there is none."""
    base = O.shm_base(base)
    try:
        st = os.statvfs(base)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def group_of(identity: dict[str, Any], base: Path | None = None) -> Path:
    return group_dir(identity["store"], identity["branch"], base, identity.get("rank"))


def _private_dir(path: Path) -> None:
    """Create ``path`` as 0700 unless it exists, and check it is ours: a
    ring read back is trusted only if nobody else could have written it.
    RingUnavailable if it is not (it is never used then)."""
    try:
        if path.parent != path and not path.parent.exists():
            path.parent.mkdir(parents=True, exist_ok=True)  # (a base of the caller's that is not there yet)
        O.make_private(path)
    except OSError as e:
        raise RingUnavailable(f"{e}; refusing to stage there") from None


#: Times a new ring's group is made again when another process's sweep
#: removed it (empty) between its creation and the ring's.
GROUP_RETRIES = 5


def _make_ring_dir(group: Path, ring: Path) -> None:
    """Create ``group`` and ``ring`` in it. A sweep in another process (any
    Capture's start, another rank's) removes a group it finds empty, which a
    new group is until its ring is in it: then the group is made again."""
    for attempt in range(GROUP_RETRIES):
        _private_dir(group)
        try:
            O.make_private(ring)
            break
        except FileNotFoundError as e:  # the group went before the ring was made in it
            if attempt + 1 == GROUP_RETRIES:
                raise RingUnavailable(f"{e}; refusing to stage there") from None
        except OSError as e:
            raise RingUnavailable(f"{e}; refusing to stage there") from None


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
    #: ``"pool"`` (create a pool file), ``"reserve"`` (reserve a piece of
    #: it: on the reserving thread, reserve.py), ``"seal"`` (write a
    #: seal's temporary file), ``"rename"`` (publish it), ``"unseal"``
    #: (remove a seal), ``"drop"`` (remove an old pool file). An OSError it
    #: raises is that operation's failure (EIO, ENOSPC... as the kernel
    #: would report them). Set it on a Ring (``cap.parts.ring.before_op = f``).
    before_op: Callable[[str, str], None] | None = None

    def __init__(self, identity: dict[str, Any], base: Path | None = None, run: str | None = None) -> None:
        self.identity = dict(identity)
        self.group = group_of(identity, base)
        problem = O.root_problem(base)
        if problem is not None:
            raise RingUnavailable(problem)
        _private_dir(ring_root(base))
        sweep(base)
        self.dir = self.group / f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        _make_ring_dir(self.group, self.dir)
        self._dir_text = os.fspath(self.dir)
        # ``run`` (a distributed Capture's id, ranks.py) is not identity: a
        # ring of an earlier run of the same store and branch is recovered.
        try:
            self._lock: int | None = O.take_ownership(self.dir, {**self.identity, **({"run": run} if run else {})})
        except OSError as e:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise RingUnavailable(f"{self.dir}: {e}") from None
        self._gen = -1
        self.pool_name = ""
        self._maps: dict[str, mmap.mmap] = {}
        #: Each pool file's reservation of its pages (reserve.py), by name.
        self.reservations: dict[str, Reservation] = {}

    def new_pool(self, capacity_bytes: int) -> torch.Tensor:
        """A fresh pool file of ``capacity_bytes`` mapped shared, its pages
        reserved (``posix_fallocate``) front to back in the background
        (:attr:`reservations`, reserve.py): a sparse file would be backed
        page by page at the first copy into each, and /dev/shm filling up
        meanwhile killed the trainer with SIGBUS at that copy (issue 23), so
        the pool (hostpool.py) hands out only bytes already reserved; the
        first step waits for its own bytes, not the whole pool's (issue 25).
        RingError (ENOSPC...) if the file cannot be made: the caller stages
        elsewhere."""
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
            os.ftruncate(fd, capacity_bytes)  # (its size; no page backed yet: the reservation's)
            mm = mmap.mmap(fd, capacity_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            buffer = torch.frombuffer(mm, dtype=torch.uint8)
            reservation = Reservation(os.dup(fd), capacity_bytes, path, address=buffer.data_ptr(),
                                      before_op=self._before_reserve)
        except OSError as e:
            with _suppress():
                os.unlink(path)  # (its pages go with it)
            raise RingError(f"reserving {capacity_bytes} bytes for the staging pool", path, e) from None
        finally:
            os.close(fd)
        reservation.start()
        self._maps[name] = mm
        self.reservations[name] = reservation
        self.pool_name = name
        return buffer

    def drop_pool(self, name: str) -> None:
        """Forget an old pool file (no sealed step refers to it any more)."""
        self._maps.pop(name, None)  # the mapping goes when its last tensor view does
        self._stop_reserving(name)
        with _suppress():
            if self.before_op is not None:
                self.before_op("drop", os.fspath(self.dir / name))
            os.unlink(self.dir / name)

    def _before_reserve(self, op: str, path: str) -> None:
        if self.before_op is not None:  # (read at each piece: a test may set it after the pool is made)
            self.before_op(op, path)

    def _stop_reserving(self, name: str | None = None) -> None:
        """Stop reserving the pages of pool file ``name`` (None: of every one)."""
        for n in [name] if name is not None else list(self.reservations):
            r = self.reservations.pop(n, None) if n is not None else None
            if r is not None:
                r.stop()

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
        self._stop_reserving()
        remove_ring(self.dir)
        O.drop(self._lock)  # (after: nobody may take it for a dead trainer's while it goes)
        self._lock = None

    def release(self) -> None:
        """Leave the ring for the next Capture, this process living on (its
        sealed steps could not be committed: the helper died)."""
        self._maps.clear()
        self._stop_reserving()
        O.release(self.dir, self._lock)
        self._lock = None


def sweep(base: Path | None = None) -> int:
    """Remove rings that can never be committed, of any store: their owner
    is proven gone (ringowner.claim) and they hold no seal record, or the
    local store they belong to is gone (judged only where the owner saw the
    same mounts), or it has no owner.json and no seal (its owner died
    making it). A ring with seals of a live store waits for the next
    Capture on its branch; one with seals whose owner.json is unreadable is
    set aside.
    The number removed."""
    removed = 0
    for group in O.groups(base):
        for ring in O.rings_in(group):
            c = O.claim(ring)
            if c is None:
                continue  # its owner lives, or that cannot be proven: not ours to judge
            owner = c.owner
            if owner is None and not _any_seal(ring):
                c.remove()  # its owner died making it (before owner.json): nothing was ever sealed in it
                removed += 1
                continue
            if owner is None or not isinstance(owner.get("store"), str):
                O.set_aside(c, c.why or "its owner.json names no store")
                continue
            store = owner["store"]
            local_gone = (store.startswith("/") and O.same_namespace(owner.get("process"), "mntns")
                          and not os.path.exists(store))
            if local_gone or not sealed_steps(ring):
                c.remove()
                removed += 1
            else:
                c.close()
        with _suppress():
            group.rmdir()  # empty: every ring of that store and branch is gone
    return removed



def unseal_file(ring: Path, step: int) -> None:
    with _suppress():
        os.unlink(ring / f"seal-{step:020d}.json")


def sealed_steps(ring: Path) -> list[int]:
    """Steps with a seal record in ``ring``, in order."""
    try:
        names = os.listdir(ring)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(_SEAL_RE.fullmatch, names) if m)


def remove_ring(ring: Path) -> None:
    shutil.rmtree(ring, ignore_errors=True)
    with _suppress():
        ring.parent.rmdir()  # when no other ring of this store and branch is left


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return isinstance(exc[1], OSError)


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


@dataclass
class Abandoned:
    """A ring of this store and branch whose owner is proven gone, held
    exclusively (``claim``) until :meth:`remove` or :meth:`set_aside`; its
    seal records in step order, every field checked."""

    claim: O.Claim
    seals: list[dict[str, Any]]

    @property
    def dir(self) -> Path:
        return self.claim.ring

    @property
    def owner(self) -> dict[str, Any]:
        return self.claim.owner or {}

    def remove(self) -> None:
        self.claim.remove()

    def set_aside(self, why: str) -> None:
        O.set_aside(self.claim, why)

    def keep(self) -> None:
        """Let go, leaving the ring as it is (a store error: the next try)."""
        self.claim.close()


def abandoned(identity: dict[str, Any], base: Path | None = None, exclude: Path | None = None, *,
              dry_run: bool = False) -> list[Abandoned]:
    """Rings of this store and branch other than ``exclude`` whose owner is
    proven gone, each held until the caller removes it, with its checked
    seal records. Rings of an earlier branch of the same name are removed;
    rings whose owner may live, of another world size or of another store
    are left alone; a ring whose owner.json or any record does not check
    out is set aside whole (one warning). ``dry_run``: nothing removed or
    set aside (only left out)."""
    out = []
    for ring in O.rings_in(group_of(identity, base)):
        if ring == exclude:
            continue
        c = O.claim(ring, tries=3)
        if c is None:
            log.info("dstt: staging ring %s is not recovered: its owner may be alive", ring)
            continue
        try:
            verdict = _judge_owner(c.owner, identity)
            if verdict != "ours":
                if verdict == "other" or dry_run:
                    c.close()
                elif verdict == "earlier":
                    log.warning("dstt: removing staging ring %s of an earlier branch named %r", ring,
                                identity["branch"])
                    c.remove()
                elif c.owner is None and not _any_seal(ring):
                    # Its owner died making it (before owner.json): nothing was ever
                    # sealed in it, so nothing is lost by removing it.
                    log.info("dstt: removing staging ring %s: its owner died before it was set up", ring)
                    c.remove()
                else:
                    O.set_aside(c, verdict or c.why)
                continue
            seals = read_seals(ring, complete="rank" not in identity)
        except CorruptRing as e:
            if dry_run:
                c.close()
            else:
                O.set_aside(c, str(e))
            continue
        except BaseException:
            c.close()
            raise
        out.append(Abandoned(c, seals))
    return out


def _any_seal(ring: Path) -> bool:
    """Whether ``ring`` holds a seal record, whole or being written."""
    return any(n.startswith("seal-") for n in os.listdir(ring))


def _judge_owner(owner: dict[str, Any] | None, identity: dict[str, Any]) -> str:
    """"ours", "other" (another store, another world size: not ours to
    judge), "earlier" (a branch of the same name deleted since), or why
    the owner.json does not check out."""
    if owner is None:
        return ""
    if owner.get("store") != identity["store"] or owner.get("branch") != identity["branch"]:
        return "other"  # (another store and branch hashed alike)
    if "world" in identity and owner.get("world") != identity["world"] and owner.get("rank") == identity["rank"]:
        return "other"  # a run of another size: for a Capture of that size, or dstt gc
    mismatch = [k for k, v in identity.items() if owner.get(k) != v]
    if not mismatch:
        return "ours"
    created = owner.get("branch_created")
    if set(mismatch) <= {"branch_id", "branch_created"} and type(created) in (int, float) \
            and created < identity["branch_created"]:
        return "earlier"
    return f"owner.json names another {', '.join(mismatch)}"


def read_seals(ring: Path, complete: bool = True) -> list[dict[str, Any]]:
    """The seal records of ``ring`` in step order, every field checked
    against the ring's pool files (sealcheck.py) and each of the format
    written now, proven by its record CRCs; CorruptRing if any is not.
    ``complete``: a single process's ring (each record holds every chunk
    of its step)."""
    names = os.listdir(ring)
    pools = {}
    for n in names:
        if _POOL_RE.fullmatch(n):
            st = os.lstat(ring / n)
            if not (st.st_mode & 0o170000 == 0o100000 and st.st_uid == os.getuid()):
                raise CorruptRing(f"{n}: not a regular file of this user")
            pools[n] = st.st_size
    seals = []
    for step in sealed_steps(ring):
        name = f"seal-{step:020d}.json"
        try:
            record = read_record(read_bounded(ring / name))
            check_record(record, step=step, pool_sizes=pools, complete=complete)
            if record.get("version") != SEAL_VERSION:  # (only an older dstt wrote them, into rings with no lock)
                raise CorruptRing(f"a record of format {record.get('version', 1)}, without a record CRC: "
                                  "what it says cannot be proven")
        except (CorruptRing, OSError) as e:
            raise CorruptRing(f"{name}: {e}") from None
        seals.append(record)
    return seals


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
    """The bytes of a file of a ring: a regular file of this user (no
    symlink followed), at most SEAL_MAX_BYTES; CorruptRing if it is not one."""
    try:
        return O.read_regular(path, SEAL_MAX_BYTES)
    except ValueError as e:
        raise CorruptRing(str(e)) from None


def recover(writer: Any, identity: dict[str, Any], *, exclude: Path | None = None, base: Path | None = None,
            finder: str = "the next Capture", found: list[Any] | None = None) -> list[int]:
    """Commit, in step order, the sealed steps of this branch's abandoned
    rings that are newer than its last commit, record each ring's crash
    as an incident, once (crashnote.py: ``finder`` found it); remove those
    rings (a ring that does not check out is set aside instead, nothing of
    it committed). The steps committed. ``writer`` (a
    :class:`~dstt.store.writer.Writer` of a single process) holds the
    branch lock. A store error propagates and keeps the ring for the next
    try. ``found``: each ring's crash is added to it (crashnote.Crash)."""
    from dstt.capture import crashnote

    done: list[int] = []
    for ring in abandoned(identity, base, exclude):
        try:
            crash = crashnote.of_ring(ring, identity["branch"])  # (before: the seals' times)
            _recover_ring(writer, identity, ring, done)
            crashnote.record_ring(writer, crash, finder, found)  # (before the ring goes: see crashnote.py)
        except CorruptRing as e:
            ring.set_aside(str(e))
            continue
        except BaseException:
            ring.keep()
            raise
        ring.remove()
    return done


def _recover_ring(writer: Any, identity: dict[str, Any], ring: Abandoned, done: list[int]) -> None:
    maps: dict[str, torch.Tensor] = {}
    try:
        for record in ring.seals:
            step = record["step"]
            if writer.last_step is not None and step <= writer.last_step and (
                    step == writer.last_step or writer.is_stored(step)):
                continue  # committed before the trainer died (an older one not stored is a backfill: Writer.adopt)
            pool = maps.get(record["pool"])
            if pool is None:
                pool = maps[record["pool"]] = map_pool(ring.dir, record["pool"])
            try:
                plan = writer.adopt(_replay(record, pool))
            except StaleSeal as e:
                log.warning("dstt: not committing a step of staging ring %s: %s", ring.dir, e)
                continue
            except (StepExistsError, StepOrderError) as e:
                log.warning("dstt: not committing step %d of staging ring %s: %s", step, ring.dir, e)
                continue
            try:
                writer.ensure_arrays(plan)
                results, error = writer.flush_chunks(plan, plan.tasks)  # (store/batchflush.py)
                if error is not None:
                    raise error
                writer.commit(plan, results)
            except (OSError, DsttError):
                raise  # the store's: the ring is kept for the next try
            except Exception as e:  # noqa: BLE001 - a record sealcheck let through that the writer refused
                raise CorruptRing(f"step {step}: {type(e).__name__}: {e}") from None
            done.append(step)
            log.warning("dstt: committed step %d of branch %r, sealed in the staging ring of a trainer that "
                        "died (%s)", step, identity["branch"], ring.dir.name)
    finally:
        maps.clear()


def _replay(record: dict[str, Any], pool: torch.Tensor) -> Any:
    """plan_of for a checked record: CorruptRing (or StaleSeal) for
    anything it refuses, never another exception."""
    try:
        return plan_of(record, pool)
    except CorruptRing:
        raise
    except Exception as e:  # noqa: BLE001 - a record sealcheck let through that plan_of refused
        raise CorruptRing(f"step {record.get('step')}: {type(e).__name__}: {e}") from None
