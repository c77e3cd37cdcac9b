"""The crash-surviving half of :class:`dstt.Capture` (issue 12): the
staging ring in /dev/shm, the helper process that commits sealed steps even
if the trainer dies, and recovery of what a dead trainer's ring sealed.

:class:`CrashSafe` is a mixin: it holds no state of its own and works on the
attributes :class:`~dstt.capture.engine.Capture` sets up (``config``,
``writer``, ``pool``, ``_ring``, ``_helper``, ``_plan_coord``...). Keeping
it apart keeps the pipeline (engine.py) readable and lets the two evolve
separately; the engine calls only the methods defined here.
"""

from __future__ import annotations

import logging
import socket
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

from dstt.capture import policy, ranks
from dstt.capture.helper import HelperHandle
from dstt.capture.helper import start as start_helper
from dstt.capture.pipeline import Job
from dstt.capture.ring import Ring, RingUnavailable, recover, seal_record, shm_free_bytes
from dstt.capture.ringowner import StagingRingWarning, root_problem
from dstt.capture.staging import HostPool
from dstt.errors import CaptureError, ConfigError, StoreLockedError
from dstt.store.backends import LocalBackend
from dstt.store.localio import pid_alive
from dstt.store.lock import lock_holder
from dstt.store.writer import CommitInfo, Writer

log = logging.getLogger("dstt.capture")

#: How long a new Capture waits for a dead trainer's helper to finish
#: committing its sealed steps (it holds the branch lock until then).
HELPER_TAIL_S = 60.0


def after_helpers(make: Callable[[], Writer], store: Any, branch: str) -> Writer:
    """``make()``, waiting (up to HELPER_TAIL_S) while the branch is locked
    by a writer whose recorded trainer is dead on this host: that is its
    capture helper finishing, and it frees the branch when done."""
    deadline = time.monotonic() + HELPER_TAIL_S
    while True:
        try:
            return make()
        except StoreLockedError:
            try:
                info = lock_holder(store, branch)
            except Exception:  # noqa: BLE001 - the original error says more
                info = None
            finishing = (info is not None and info.pid is not None and info.host == socket.gethostname()
                         and not pid_alive(info.pid))
            if not finishing or time.monotonic() > deadline:
                raise
            time.sleep(0.05)



def _why(problem: str | None) -> str:
    return "" if problem is None else f" ({problem})"


def _not_staging_in_shm(problem: str) -> None:
    """Say once why this Capture stages in process memory, not in /dev/shm."""
    warnings.warn(f"dstt: not staging in /dev/shm: {problem}; staging in process memory instead (steps not yet "
                  "committed are lost if the trainer dies)", StagingRingWarning, stacklevel=5)


class CrashSafe:
    """Ring, helper and recovery methods of :class:`~dstt.capture.engine.Capture`."""

    config: Any
    writer: Writer
    pool: HostPool | None
    _ring: Ring | None
    _helper: HelperHandle | None
    _pool_in_ring: bool
    _plan_coord: Any
    _store_by_name: bool
    recovered: list[int]
    _run_id: str = ""  # a distributed Capture's id in its ranks' records (ranks.py)

    def _commit_by_helper(self, job: Job) -> CommitInfo:
        """Helper mode: the helper writes and commits the sealed step (under
        torch.distributed: records it; rank 0's helper commits); a step that
        failed here, or could not be sealed, fails -- on every rank: this
        rank records the failure for rank 0's helper."""
        assert self._helper is not None
        step = job.plan.step
        try:
            if job.error is not None:
                raise job.error
            if not job.sealed:
                raise CaptureError(
                    f"step {step} not committed: it was not sealed in the staging ring (a step must fit "
                    "the pool whole to be handed to the capture helper: raise host_buffer_bytes, or helper=False "
                    "to stage larger steps in parts)")
            # (pipelined: handed over by the stager once sealed, _seal)
            # bounded: by the helper's progress (HelperHandle._answer: background_timeout_s, then it is killed)
            info = CommitInfo(**(self._helper.receive(step) if job.sent else self._helper.commit(step)))
            job.info = info  # committed: the helper removed its seal before answering (_settle)
            return info
        except BaseException as e:
            if self._plan_coord.distributed:  # (also when the helper answered: a record it could not write
                self._record_failure(job, e)  # left rank 0's helper waiting RANK_WAIT_S; a no-op if it did)
            raise

    def _record_failure(self, job: Job, e: BaseException) -> None:
        """Tell rank 0's helper that this rank's part of a step failed (it
        was never handed to this rank's helper, or that helper is gone)."""
        coord, backend, branch = self._plan_coord, self.writer.backend, self.writer.branch.name
        step, seq, why = job.plan.step, job.plan.seq, f"{type(e).__name__}: {e}"
        try:
            have = ranks.read_record(backend, branch, step, coord.rank)
            if have is not None and have["run"] == self._run_id and have["seq"] == seq:
                return  # the helper recorded it before it was lost
            ranks.write_record(backend, branch, step, seq, self._run_id, coord.rank, coord.world, error=why)
            if coord.rank == 0:  # rank 0's helper will not answer the others for this step
                ranks.write_fail(backend, branch, step, seq, self._run_id, f"rank 0: {why}")
        except Exception as err:  # noqa: BLE001 - rank 0's helper then times out on this step
            log.error("dstt: could not record the failure of step %d: %s", job.plan.step, err)

    def _open_ring(self) -> Ring | None:
        """This Capture's ring in /dev/shm (see ring.py), after committing
        what rings of dead trainers sealed. Under torch.distributed every
        rank has one (or none does)."""
        coord = self._plan_coord
        able = self.config.shm is not False and shm_free_bytes() is not None
        problem = root_problem() if able else None  # (another user's root: never used, never fatal)
        able = able and problem is None
        if coord.distributed:
            able = all(coord.all_gather(able))  # every rank stages alike
        if not able:
            if self.config.shm is True:
                raise ConfigError(f"shm=True: staging in /dev/shm needs /dev/shm on every rank{_why(problem)}")
            if problem is not None:
                _not_staging_in_shm(problem)
            return None
        if coord.distributed:
            return self._open_rank_ring()
        info = self.writer.branch
        identity = {"store": str(self.writer.backend.url), "branch": info.name, "branch_id": info.id,
                    "branch_created": info.created}
        try:
            ring = Ring(identity)
        except RingUnavailable as e:
            if self.config.shm is True:
                raise ConfigError(f"shm=True: {e}") from None
            _not_staging_in_shm(str(e))
            return None
        try:
            recovered = recover(self.writer, identity, exclude=ring.dir)
        except BaseException:
            ring.close()
            self.writer.close()
            raise
        self.recovered = recovered
        return ring

    def _open_rank_ring(self) -> Ring:
        """This rank's ring, after recovery (collective): each rank records
        the sealed, unrecorded steps of its own dead rings; then rank 0
        commits the steps every rank recorded (ranks.py)."""
        coord = self._plan_coord
        self._run_id = coord.broadcast(uuid.uuid4().hex if coord.rank == 0 else None)
        identity = ranks.ring_identity(str(self.writer.backend.url), self.writer.branch, coord.rank, coord.world)
        ring: Ring | None = None
        error: str | None = None
        try:
            ring = Ring(identity, run=self._run_id)
            ranks.record_rings(self.writer, identity, exclude=ring.dir)
        except Exception as e:  # noqa: BLE001 - agreed on below, so no rank waits for another
            error = f"rank {coord.rank}: {type(e).__name__}: {e}"
        errors = [x for x in coord.all_gather(error) if x is not None]
        outcome: Any = None
        if not errors:
            # Rank 0 broadcasts its outcome or its error: every rank takes part
            # (rank 0 failing alone used to skip it, leaving the others waiting).
            if coord.rank == 0:
                try:
                    done = ranks.commit_recorded(self.writer)
                    outcome = (done, self.writer.last_step, self.writer.last_commit, self.writer.next_seq)
                except Exception as e:  # noqa: BLE001
                    outcome = f"rank 0: {type(e).__name__}: {e}"
            outcome = coord.broadcast(outcome if coord.rank == 0 else None)
            if not isinstance(outcome, tuple):
                errors = [str(outcome or "rank 0: recovery failed")]
        if errors or ring is None:
            if ring is not None:
                ring.close()
            self.writer.close()
            raise CaptureError("recovering the steps sealed by an earlier run failed: " + "; ".join(errors))
        done, last_step, last_commit, next_seq = outcome
        # Every rank's writer continues after what rank 0 committed.
        self.writer.last_step, self.writer.last_commit, self.writer.next_seq = last_step, last_commit, next_seq
        self.recovered = list(done)
        return ring

    def _start_helper(self) -> HelperHandle | None:
        """The helper process (helper.py) where it can run: a ring, a local
        store (a shared flock), Linux. Started, not waited for. Under
        torch.distributed one per rank, on every rank or on none."""
        coord = self._plan_coord
        lock = getattr(self.writer, "_branch_lock", None)
        fd = lock.fileno() if lock is not None and hasattr(lock, "fileno") else None
        local = type(self.writer.backend) is LocalBackend  # the helper opens the store by its path
        able = self._ring is not None and (fd is not None or coord.rank != 0) and sys.platform.startswith("linux")
        # auto: only with an auto-sized pool (it always holds a whole step); an
        # explicit host_buffer_bytes may be meant to stage steps in parts.
        # A Backend object given by the caller stays in this process: the helper
        # would act on another instance of it, invisible to the caller.
        auto = self.config.helper is None and self.config.host_buffer_bytes is None and self._store_by_name
        use = bool(self.config.helper or auto) and able and (local or not auto)
        if coord.distributed:
            use = all(coord.all_gather(use))
        if not use:
            if self.config.helper is True:
                raise ConfigError("helper=True needs /dev/shm and a local store (on every rank)")
            return None
        if not local:
            raise ConfigError(f"helper=True: the capture helper process opens the store by its path; a "
                              f"{type(self.writer.backend).__name__} object cannot move into it (pass the path, "
                              "or use helper=False)")
        cfg = self.config
        options = {"branch": cfg.branch, "compression": cfg.compression, "zstd_level": cfg.zstd_level,
                   "keyframe_every": cfg.keyframe_every, "max_chunk_bytes": cfg.max_chunk_bytes,
                   "allow_pickle": cfg.allow_pickle, "dedup": cfg.dedup}
        dist = {"rank": coord.rank, "world": coord.world, "run": self._run_id} if coord.distributed else None
        assert self._ring is not None
        return start_helper(options, str(self.writer.backend.url), self._ring.dir, fd, cfg.background_nice, dist,
                            idle=cfg.background_idle, timeout_s=cfg.background_timeout_s,
                            on_progress=self._bump)  # type: ignore[attr-defined]

    def _new_pool(self, capacity: int, pin: bool) -> HostPool:
        """A pool in the ring's /dev/shm file where it fits (policy.shm_decision),
        else in process memory with a warning (or an error with shm=True)."""
        old, was_ring = self.pool, self._pool_in_ring
        capacity = -(-capacity // 4096) * 4096  # the file in whole pages
        self._pool_in_ring = False
        if self._ring is not None:
            decision = policy.shm_decision(pool_bytes=capacity, shm_free_bytes=shm_free_bytes())
            if decision.where == "shm":
                if old is not None and was_ring:
                    old.unregister()
                    self._ring.drop_pool(self._ring.pool_name)
                pool = HostPool(capacity, pin=pin, buffer=self._ring.new_pool(capacity))
                self._pool_in_ring = True
                return pool
            if self.config.shm is True:
                raise CaptureError(f"shm=True: {decision.warning}")
            warnings.warn(f"dstt: {decision.warning}", RuntimeWarning, stacklevel=5)
        return HostPool(capacity, pin=pin)

    def _seal(self, job: Job) -> None:
        """Every copy of a held step has landed: record it in the ring, so
        the step is committed even if this process dies now (ring.py).

        Without CRCs (a pass over the step's bytes, ~0.1 ms of the stager's
        GIL per 1.2 MB step: issue 16): a seal written here never outlives
        its bytes -- the step's blocks go back only in :meth:`_settle`, once
        the seal is removed (committed by the helper, or by this process)
        or rewritten with the CRC of every byte (a step the helper did not
        commit: recovery then skips it if its blocks were reused). So
        recovery commits a seal without CRCs as it is, and checks every
        seal whose blocks may have been reused."""
        try:
            for ev in job.cuda_eager:
                ev.synchronize()  # unbounded wait: this step's copies on the GPU (device work, no other party)
            assert self._ring is not None and job.pool is not None
            self._ring.seal(seal_record(job.plan, self._ring.pool_name, job.pool.buffer, job.views,
                                        crc=False, groups=job.groups))
            job.sealed = True
        except Exception as e:  # noqa: BLE001 - the step is still captured, only not crash-proof
            log.warning("dstt: step %d not sealed in the staging ring (%s): it is lost if the trainer dies "
                        "before it is committed", job.plan.step, e)
        helper = self._helper
        if job.sealed and helper is not None and not self._plan_coord.distributed and not helper.lost:
            # Pipelined (committing.py): handed over now, in stage order -- the
            # order of the commit queue -- and its answer read by the committer.
            try:
                helper.send(job.plan.step)
                job.sent = True
            except BaseException as e:  # the helper is gone: the step fails (_commit_by_helper)
                job.error = job.error or e

    def _settle(self, job: Job) -> None:
        """After a step's commit (or failure): forget its seal, free its held blocks."""
        release = job.hold and job.pool is not None
        if job.sealed and self._ring is not None:
            if self._helper is None:
                release = release and self._unseal(job.plan.step)
            elif job.info is None:
                # The helper did not commit it (it failed, or the helper is gone):
                # the seal stays for the next Capture, checked by CRC, since its
                # blocks are reused from now on (_seal says why it had none).
                release = release and self._seal_checked(job)
            # (committed by the helper: it removed the seal before answering)
        if release:
            assert job.pool is not None
            job.pool.release_many([block for _, block in job.groups] + [view for _, view in job.views])
        job.views = []
        job.groups = []

    def _seal_checked(self, job: Job) -> bool:
        """Rewrite ``job``'s seal with the CRC-32C of every chunk's bytes
        (or else remove it); False if neither could be done: then its
        blocks must never be reused (a seal without CRCs must not outlive
        its bytes), and they stay reserved."""
        assert self._ring is not None and job.pool is not None
        try:
            self._ring.seal(seal_record(job.plan, self._ring.pool_name, job.pool.buffer, job.views,
                                        groups=job.groups))
            return True
        except Exception as e:  # noqa: BLE001 - then the seal goes
            log.warning("dstt: step %d not committed and its seal could not be checksummed (%s): removing it",
                        job.plan.step, e)
        return self._unseal(job.plan.step)

    def _unseal(self, step: int) -> bool:
        """Remove ``step``'s seal; False (logged) if it could not be."""
        assert self._ring is not None
        try:
            self._ring.unseal(step, strict=True)
            return True
        except OSError as e:
            log.error("dstt: could not remove the seal of step %d (%s): its staging blocks stay reserved",
                      step, e)
            return False

