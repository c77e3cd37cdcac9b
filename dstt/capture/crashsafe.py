"""The crash-surviving part of :class:`dstt.Capture` (issue 12): the
staging ring in /dev/shm, the helper process that commits sealed steps even
if the trainer dies, and recovery of what a dead trainer's ring sealed.

:class:`CrashSafe` is a component: it owns the ring, the seal keeper, the
helper's handle and the fallback committer; the Capture builds it once and
the committers call its public methods (seal, settle, commit_by_helper...).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

from dstt.capture import crashnote, nodeloss, parityrecover, policy, ranks, rebuilt, replicaguard, rsrecover
from dstt.capture.committers import HAND_OVER_LOCK
from dstt.capture.config import write_options
from dstt.capture.current import Current
from dstt.capture.fallback import HereCommitter
from dstt.capture.helper import HelperHandle
from dstt.capture.helper import start as start_helper_process
from dstt.capture.hostpool import HostPool
from dstt.capture.keeper import SealKeeper
from dstt.capture.ledger import Ledger
from dstt.capture.pipeline import Job
from dstt.capture.ring import Ring, RingUnavailable, recover, seal_record, shm_free_bytes
from dstt.capture.ringowner import root_problem
from dstt.errors import CaptureError, ConfigError, HelperLostWarning, StagingRingWarning, StoreLockedError
from dstt.format.backends import LocalBackend
from dstt.format.commit import CommitInfo
from dstt.format.localio import pid_alive
from dstt.format.lock import lock_holder
from dstt.format.rankparts import read_record, write_fail, write_record
from dstt.format.redundancy import parse_scheme
from dstt.format.writeoptions import WriteOptions
from dstt.store.coord import Coordinator
from dstt.store.writer import Writer

log = logging.getLogger("dstt.capture")

_KEEPER_LOCK = threading.Lock()

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



def _guarded(fn: Any, *args: Any) -> str | None:
    """``fn(*args)``; None, or the error it raised as one line (agreed on by the ranks)."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - gathered by the caller, so no rank waits for another
        return f"{type(e).__name__}: {e}"
    return None


def _record_crashes(writer: Writer, crashes: list[crashnote.Crash]) -> None:
    """Rank 0, after committing what the rings of dead runs held: each
    run's crash incident, once (crashnote.py). Its steps are committed
    and its rings gone: a record that cannot be written is logged, not
    raised (this Capture goes on)."""
    for crash in crashes:
        try:
            crashnote.record(writer.backend, crash, writer.is_stored, crashnote.BY_CAPTURE)
        except Exception as e:  # noqa: BLE001 - the steps are stored; only the incident record is lost
            log.error("dstt: the crash of run %s (steps %s) could not be recorded as an incident: %s", crash.run,
                      sorted(crash.sealed), e)


def _why(problem: str | None) -> str:
    return "" if problem is None else f" ({problem})"


def _not_staging_in_shm(problem: str) -> None:
    """Say once why this Capture stages in process memory, not in /dev/shm."""
    warnings.warn(f"dstt: not staging in /dev/shm: {problem}; staging in process memory instead (steps not yet "
                  "committed are lost if the trainer dies)", StagingRingWarning, stacklevel=5)


class CrashSafe:
    """The staging ring in /dev/shm, the capture helper and recovery of a
    :class:`~dstt.capture.engine.Capture` (see the module docstring).

    Built once by the Capture with what it uses: the Capture's ``config``
    and ``writer`` as they are now (:class:`~dstt.capture.current.Current`),
    the ledger, the planning coordinator, and whether the store was given
    by its path. The constructor opens the ring (after committing what
    rings of dead trainers sealed: :attr:`recovered`).

    Phase protocol (who calls what, on which thread):

    1. trainer, constructor: the ring (:attr:`ring`, :attr:`recovered`);
       ``make_committer``: :meth:`start_helper`;
    2. trainer, the first snapshot (and a pool that grows): :meth:`new_pool`;
    3. stager: :meth:`seal` once every copy of a held step landed;
    4. committer thread: :meth:`commit_by_helper` (helper mode), then
       :meth:`settle` for every step;
    5. trainer, a rewind: :meth:`leave_branch`, :meth:`rejoin_branch`;
       ``close()``: :meth:`close_ring`.
    """

    def __init__(self, current: Current, ledger: Ledger, coord: Coordinator, *, store_by_name: bool) -> None:
        self.current = current
        self.ledger = ledger
        self.coord = coord
        self._store_by_name = store_by_name
        self.recovered: list[int] = []  # steps sealed by a dead trainer, committed at construction
        self.run_id = ""  # a distributed Capture's id in its ranks' records (ranks.py)
        self.helper: HelperHandle | None = None  # started by make_committer where it can run
        self._kept: SealKeeper | None = None  # (see keeper)
        #: Commits in this process once the capture helper cannot (fallback.py); None while it can.
        self._here: HereCommitter | None = None
        #: The stager hands sealed steps to the helper (False from the first step it cannot take on).
        self.hand_over = True
        self._seal_trouble: str | None = None  # why the latest step was not sealed (logged when it changes)
        #: The newest step the recovery committed, as the rings held it (until the first snapshot).
        self.rebuilt: rebuilt.Kept | None = None
        self.ring: Ring | None = self._open_ring()  # before any thread: recovery commits on this thread

    @property
    def keeper(self) -> SealKeeper | None:
        """Who says whether staging bytes a seal describes may be reused
        (keeper.py): the one of the current ring (a rewind opens another);
        None without a ring. Made with the ring's first pool, on the
        trainer's thread."""
        ring = self.ring
        if ring is None:
            return None
        kept = self._kept
        if kept is None or kept.ring is not ring:
            with _KEEPER_LOCK:
                kept = self._kept
                if kept is None or kept.ring is not ring:
                    kept = self._kept = SealKeeper(ring)
        return kept

    def commit_by_helper(self, job: Job) -> CommitInfo:
        """Helper mode: the helper writes and commits the sealed step (under
        torch.distributed: records it; rank 0's helper commits). Once it
        cannot take a step -- it died, or the step is not sealed -- this
        process commits that step and every later one (:meth:`retire_helper`,
        fallback.py); under torch.distributed the step fails instead, on
        every rank: this rank records the failure for rank 0's helper."""
        assert self.helper is not None
        step = job.plan.step
        try:
            if job.error is not None:
                raise job.error
            if self._here is None:
                helper = self.helper
                why = self._why_not_handed(job)
                if why is None:
                    try:  # (pipelined: handed over by the stager once sealed, _seal)
                        # bounded: by the helper's progress (HelperHandle._answer: background_timeout_s, then killed)
                        info = CommitInfo(**(helper.receive(step) if job.ring.sent else helper.commit(step)))
                        job.info = info
                        return info
                    except CaptureError as e:
                        if not helper.lost:
                            raise  # the helper failed the step itself: it failed
                        why = f"the capture helper (pid {helper.pid}) {helper.lost_why or self._helper_end(helper)}"
                        if self.coord.distributed:
                            raise CaptureError(f"step {step} not committed: {why}; under torch.distributed a "
                                               "rank's steps are committed only through its helper: this step "
                                               "and later ones fail (their sealed bytes stay reserved): close "
                                               "this Capture; the next one, or dstt gc, commits what was "
                                               "sealed") from e
                self.retire_helper(job, why)
            assert self._here is not None
            done: CommitInfo = self._here.commit(job)
            job.info = done
            return done
        except BaseException as e:
            if self.coord.distributed:  # (also when the helper answered: a record it could not write
                self._record_failure(job, e)  # left rank 0's helper waiting RANK_WAIT_S; a no-op if it did)
            raise

    def refuse_without_helper(self, helper: HelperHandle, step: int) -> None:
        """Under torch.distributed, once this rank's ``helper`` is gone, a new
        step is not staged at all (it would fail anyway, and the pool keeps
        the sealed steps it did not commit): CaptureError."""
        if helper.lost and self.coord.distributed:
            raise CaptureError(f"step {step} not captured: this rank's capture helper (pid {helper.pid}) "
                               f"{self._helper_end(helper)}; close this Capture (the next one, or dstt gc, commits "
                               "the steps it left sealed)")

    def _why_not_handed(self, job: Job) -> str | None:
        """Why ``job`` cannot go to the capture helper; None if it can."""
        if job.ring.sealed and (job.ring.sent or self.hand_over):
            return None
        if not job.ring.sealed:
            return f"step {job.plan.step} could not be sealed for the capture helper: {job.ring.seal_error}"
        assert self.helper is not None  # (helper mode: HelperCommitter.commit)
        if self.helper.closed:  # (committing here failed to start before)
            return "the capture helper was stopped at an earlier step it could not take"
        return f"step {job.plan.step} came after one that could not be sealed"

    @staticmethod
    def _helper_end(helper: HelperHandle) -> str:
        """How the helper ended, in words."""
        code = helper.proc.poll()
        if code is None:
            return "stopped answering"
        if code < 0:
            import signal

            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with status {code}"

    def retire_helper(self, job: Job, why: str) -> None:
        """From ``job`` on (single process), commit in this process: the
        helper cannot take it. It is killed first (no two writers of the
        branch at once; SIGKILL: a helper's own exit would release the branch
        lock it shares with this process). A live one has nothing left to
        do: it answered every step handed to it (the committer takes the
        answers in order, and the stager hands over nothing after a step it
        could not seal)."""
        helper = self.helper
        assert helper is not None
        if self.coord.distributed:  # (a rank's steps go through its helper's records: ranks.py)
            raise CaptureError(f"step {job.plan.step} not committed: {why}")
        with contextlib.suppress(OSError):
            helper.proc.kill()  # (first: a send blocked on its full pipe ends with EPIPE)
        with HAND_OVER_LOCK:  # no send is under way, none starts (its pipe's descriptor goes now)
            self.hand_over = False
        helper.close()
        self._here = HereCommitter(self.current.writer, self._writer_options().but(branch=self.current.writer.branch.name))
        text = (f"dstt: {why}; from step {job.plan.step} on, this Capture commits in this process (its own "
                "threads, as with helper=False): no step is lost, and a step sealed in /dev/shm still survives a crash "
                "(the next Capture or dstt gc commits it)")
        log.error("%s", text)
        warnings.warn(text, HelperLostWarning, stacklevel=2)

    def _record_failure(self, job: Job, e: BaseException) -> None:
        """Tell rank 0's helper that this rank's part of a step failed (it
        was never handed to this rank's helper, or that helper is gone)."""
        coord, backend, branch = self.coord, self.current.writer.backend, self.current.writer.branch.name
        step, seq, why = job.plan.step, job.plan.seq, f"{type(e).__name__}: {e}"
        try:
            have = read_record(backend, branch, step, coord.rank)
            if have is not None and have["run"] == self.run_id and have["seq"] == seq:
                return  # the helper recorded it before it was lost
            write_record(backend, branch, step, seq, self.run_id, coord.rank, coord.world, error=why)
            if coord.rank == 0:  # rank 0's helper will not answer the others for this step
                write_fail(backend, branch, step, seq, self.run_id, f"rank 0: {why}")
        except Exception as err:  # noqa: BLE001 - rank 0's helper then times out on this step
            log.error("dstt: could not record the failure of step %d: %s", job.plan.step, err)

    def _open_ring(self) -> Ring | None:
        """This Capture's ring in /dev/shm (see ring.py), after committing
        what rings of dead trainers sealed. Under torch.distributed every
        rank has one (or none does)."""
        coord = self.coord
        able = self.current.config.shm is not False and shm_free_bytes() is not None
        problem = root_problem() if able else None  # (another user's root: never used, never fatal)
        able = able and problem is None
        if coord.distributed:
            able = all(coord.all_gather(able))  # every rank stages alike
        if not able:
            if self.current.config.shm is True:
                raise ConfigError(f"shm=True: staging in /dev/shm needs /dev/shm on every rank{_why(problem)}")
            if problem is not None:
                _not_staging_in_shm(problem)
            return None
        if coord.distributed:
            with rebuilt.keeping() as kept:  # (every rank's part of the newest step recovered: rebuilt.py)
                rank_ring = self._open_rank_ring()
            self.rebuilt = kept.newest(self.recovered) if self.recovered else None  # (alike on every rank)
            return rank_ring
        info = self.current.writer.branch
        identity = {"store": str(self.current.writer.backend.url), "branch": info.name, "branch_id": info.id,
                    "branch_created": info.created}
        try:
            ring = Ring(identity)
        except RingUnavailable as e:
            if self.current.config.shm is True:
                raise ConfigError(f"shm=True: {e}") from None
            _not_staging_in_shm(str(e))
            return None
        try:
            recovered = recover(self.current.writer, identity, exclude=ring.dir)
        except BaseException:
            ring.close()
            self.current.writer.close()
            raise
        self.recovered = recovered
        return ring

    def _open_rank_ring(self) -> Ring:
        """This rank's ring, after recovery (collective): each rank records
        the sealed, unrecorded steps of its own dead rings; then rank 0
        commits the steps every rank recorded (ranks.py)."""
        coord = self.coord
        self.run_id = coord.broadcast(uuid.uuid4().hex if coord.rank == 0 else None)
        identity = ranks.ring_identity(str(self.current.writer.backend.url), self.current.writer.branch, coord.rank, coord.world)
        ring: Ring | None = None
        error: str | None = None
        found: list[crashnote.Crash] = []  # the crashes of the rings recovered (rank 0 records them)
        held = replicaguard.Pending()
        scheme = self.current.config.redundancy  # ("auto": replicas or pair, chosen at the first snapshot)
        if scheme != "auto" and parse_scheme(scheme).kind == "parity":  # (collective, never raises)
            # a lost node's steps, from parity (issue 26; parity:k+m, m > 1: Reed-Solomon, capture/rsrecover.py)
            (rsrecover if parse_scheme(scheme).m > 1 else parityrecover).recover(self.current.writer, coord)
        try:
            ring = Ring(identity, run=self.run_id)
            nodeloss.recover_copies(self.current.writer, coord.world)  # a lost node's steps, from copies here (issue 26)
            held = replicaguard.stage(self.current.writer, identity, exclude=ring.dir)  # ... and from replicas
            ranks.record_rings(self.current.writer, identity, exclude=ring.dir, found=found)
        except Exception as e:  # noqa: BLE001 - agreed on below, so no rank waits for another
            error = f"rank {coord.rank}: {type(e).__name__}: {e}"
        gathered = coord.all_gather((error, found))
        errors = [x for x, _ in gathered if x is not None]
        crashes = crashnote.merged(c for _, part in gathered for c in part)  # (one per run, every rank's rings)
        if not errors:  # (collective: rebuilt from replicas where no rank recorded its own part)
            errors = [x for x in coord.all_gather(_guarded(replicaguard.finish, self.current.writer, coord, held))
                      if x is not None]
        held.drop()
        outcome: Any = None
        if not errors:
            # Rank 0 broadcasts its outcome or its error: every rank takes part
            # (rank 0 failing alone used to skip it, leaving the others waiting).
            if coord.rank == 0:
                try:
                    done = ranks.commit_recorded(self.current.writer)
                    nodeloss.report_unrebuilt(self.current.writer)  # (steps a lost node took: named once)
                    _record_crashes(self.current.writer, crashes)
                    outcome = (done, self.current.writer.last_step, self.current.writer.last_commit, self.current.writer.next_seq)
                except Exception as e:  # noqa: BLE001
                    outcome = f"rank 0: {type(e).__name__}: {e}"
            outcome = coord.broadcast(outcome if coord.rank == 0 else None)
            if not isinstance(outcome, tuple):
                errors = [str(outcome or "rank 0: recovery failed")]
        if errors or ring is None:
            if ring is not None:
                ring.close()
            self.current.writer.close()
            raise CaptureError("recovering the steps sealed by an earlier run failed: " + "; ".join(errors))
        done, last_step, last_commit, next_seq = outcome
        # Every rank's writer continues after what rank 0 committed.
        self.current.writer.last_step, self.current.writer.last_commit, self.current.writer.next_seq = last_step, last_commit, next_seq
        self.recovered = list(done)
        return ring

    def start_helper(self, tier: dict[str, Any] | None = None) -> HelperHandle | None:
        """The helper process (helper.py) where it can run: a ring, a local
        store (a shared flock), Linux. Started, not waited for. Under
        torch.distributed one per rank, on every rank or on none."""
        coord = self.coord
        lock = self.current.writer.branch_lock
        fd = lock.fileno() if lock is not None and hasattr(lock, "fileno") else None
        local = type(self.current.writer.backend) is LocalBackend  # the helper opens the store by its path
        able = self.ring is not None and (fd is not None or coord.rank != 0) and sys.platform.startswith("linux")
        # auto: only with an auto-sized pool (it always holds a whole step); an
        # explicit host_buffer_bytes may be meant to stage steps in parts.
        # A Backend object given by the caller stays in this process: the helper
        # would act on another instance of it, invisible to the caller.
        auto = self.current.config.helper is None and self.current.config.host_buffer_bytes is None and self._store_by_name
        use = bool(self.current.config.helper or auto) and able and (local or not auto)
        if coord.distributed:
            use = all(coord.all_gather(use))
        if not use:
            if self.current.config.helper is True:
                raise ConfigError("helper=True needs /dev/shm and a local store (on every rank)")
            return None
        if not local:
            raise ConfigError(f"helper=True: the capture helper process opens the store by its path; a "
                              f"{type(self.current.writer.backend).__name__} object cannot move into it (pass the path, "
                              "or use helper=False)")
        cfg = self.current.config
        options = self._writer_options().shipped()
        dist = {"rank": coord.rank, "world": coord.world, "run": self.run_id} if coord.distributed else None
        assert self.ring is not None
        self.hand_over = True
        return start_helper_process(options, str(self.current.writer.backend.url), self.ring.dir, fd, cfg.background_nice, dist,
                            idle=cfg.background_idle, timeout_s=cfg.background_timeout_s,
                            on_progress=self.ledger.bump, tier=tier)

    def _writer_options(self) -> WriteOptions:
        """The options of a Writer storing this Capture's steps elsewhere (the
        helper's, fallback.py's): of the branch as it exists (no parent to fork
        from), coding on ``encode_threads``."""
        cfg = self.current.config
        return write_options(cfg, parent=None, compression=cfg.compression or self.current.writer.codec.compression,
                             threads=cfg.encode_threads)

    def new_pool(self, capacity: int, pin: bool, old: HostPool | None) -> HostPool:
        """A pool in a new /dev/shm file of the ring where it fits
        (policy.shm_decision) and can be backed (every page reserved: ring.py),
        else in process memory with a warning (or an error with shm=True).
        The previous pool's file goes once no seal names it (keeper.py)."""
        was_ring = old is not None and old.ring_name is not None
        capacity = -(-capacity // 4096) * 4096  # the file in whole pages
        pool: HostPool | None = None
        warning = None
        if self.ring is not None and self.keeper is not None:
            decision = policy.shm_decision(pool_bytes=capacity, shm_free_bytes=shm_free_bytes())
            warning = decision.warning
            if self.keeper.broken is not None:
                warning = f"the staging ring is retired ({self.keeper.broken}): staged in process memory"
            elif decision.where == "shm":
                try:
                    buffer = self.ring.new_pool(capacity)  # (its pages reserved in the background: reserve.py)
                    pool = HostPool(capacity, pin=pin, buffer=buffer,
                                    reservation=self.ring.reservations.get(self.ring.pool_name))
                    pool.ring_name = self.ring.pool_name  # (Stager.pool_in_ring)
                    self._watch_reservation(pool)
                except OSError as e:
                    warning = f"{e}: staged in process memory instead"
            if pool is None:
                if self.current.config.shm is True:
                    raise CaptureError(f"shm=True: {warning}")
                warnings.warn(f"dstt: {warning}", StagingRingWarning, stacklevel=5)
        if old is not None and was_ring:
            if old.retired is None:  # (a retired pool may still be copied into by steps in flight)
                old.unregister()
            if self.keeper is not None and old.ring_name is not None:
                self.keeper.drop_pool(old.ring_name)
        return pool if pool is not None else HostPool(capacity, pin=pin)

    def _watch_reservation(self, pool: HostPool) -> None:
        """Each piece of ``pool``'s file reserved is progress (a step waits
        for it through the ledger); a reservation that ends short retires
        the pool: the next step is staged in a new one (here: in process
        memory, with a warning, if /dev/shm is still full)."""
        reservation = pool.reservation
        if reservation is None:
            return
        ledger = self.ledger

        def reserved() -> None:
            ledger.bump()
            if reservation.done.is_set() and reservation.error is not None:
                pool.retire(f"its file could not be reserved ({reservation.error})")

        reservation.listen(reserved)

    def seal(self, job: Job) -> None:
        """Every copy of a held step has landed: record it in the ring, so
        the step is committed even if this process dies now (ring.py).

        Without CRCs (a pass over the step's bytes, ~0.1 ms of the stager's
        GIL per 1.2 MB step: issue 16): a seal written here never outlives
        its bytes -- the step's blocks go back only when the keeper says so
        (:meth:`settle`, keeper.py): once the seal is removed (committed by
        the helper, or by this process) or rewritten with the CRC of every
        byte (a step not committed: recovery then skips it if its blocks
        were reused). So recovery commits a seal without CRCs as it is, and
        checks every seal whose blocks may have been reused.

        A step that cannot be sealed is still captured (only not
        crash-safe, said when that starts and when it ends); with the
        capture helper, which takes sealed steps only, this process commits
        it and every later one (:meth:`commit_by_helper`)."""
        try:
            for ev in job.cuda_eager:
                ev.synchronize()  # unbounded wait: this step's copies on the GPU (device work, no other party)
            assert self.ring is not None and self.keeper is not None and job.ring.pool is not None
            name = job.ring.pool.ring_name
            if name is None:
                raise RuntimeError("the staging pool is in process memory, not in the /dev/shm ring (see the "
                                   "warning given when it was made)")
            pool = job.ring.pool.buffer[:job.ring.pool.file_bytes]  # (a block past it is not the file's: reserve.py)
            self.keeper.seal(seal_record(job.plan, name, pool, job.ring.views, crc=False, groups=job.ring.groups))
            job.ring.sealed = True
        except Exception as e:  # noqa: BLE001 - the step is still captured, only not crash-proof
            job.ring.seal_error = str(e)
        self.note_sealing(job)

    def note_sealing(self, job: Job) -> None:
        """Log when steps stop being sealed (why), and when they are again."""
        why = job.ring.seal_error
        if why == self._seal_trouble or (why is not None and self._seal_trouble is not None
                                          and self.keeper is not None and self.keeper.broken is not None):
            return
        if why is None:
            log.warning("dstt: steps are sealed in the staging ring again from step %d on", job.plan.step)
        else:
            log.warning("dstt: step %d not sealed in the staging ring (%s): until steps are sealed again, a step "
                        "not yet committed is lost if the trainer dies", job.plan.step, why)
        self._seal_trouble = why

    def settle(self, job: Job, keep: bool = False) -> None:
        """After a step's commit (or failure): its seal settled by the keeper,
        its held blocks freed if the keeper says they may be reused; ``keep``:
        its seal is kept for the next Capture, its blocks never reused
        (a step a lost helper did not commit under torch.distributed:
        HelperCommitter.settle)."""
        release = job.ring.hold and job.ring.pool is not None
        keeper = self.keeper
        if job.ring.sealed and keeper is not None and job.ring.pool is not None:
            step, pool = job.plan.step, job.ring.pool
            if keep:
                keeper.keep(step)  # for the next Capture: never reused (commit_by_helper said so)
                release = False
            else:
                # Removed if committed (by the helper, already: a no-op unlink; if
                # it could not, the keeper tries), else rewritten with CRCs first.
                release = release and keeper.settle(
                    step, recoverable=job.info is None,
                    checked=lambda: seal_record(job.plan, pool.ring_name or "", pool.buffer, job.ring.views,
                                                groups=job.ring.groups))
            if not release:
                pool.pin([block for _, block in job.ring.groups] + [view for _, view in job.ring.views])
                pool.retire(f"step {step}'s sealed bytes in this staging pool stay reserved (its seal describes "
                            "them); later steps are staged in a new pool")
        if release:
            assert job.ring.pool is not None
            job.ring.pool.release_many([block for _, block in job.ring.groups] + [view for _, view in job.ring.views])
        job.ring.views = []
        job.ring.groups = []

    def leave_branch(self) -> None:
        """Without the memory tier, a rewind: everything is stored; let go of
        the old branch's ring (per branch; its helper: Committer.leave_branch;
        the stager's pool in it: Stager.drop_pool, first)."""
        self.helper = None
        self.close_ring()
        self.ring = None

    def rejoin_branch(self) -> None:
        """A ring for the new branch, as the constructor makes it (its helper: make_committer)."""
        self.ring = self._open_ring()

    def close_ring(self) -> None:
        """Let go of the ring (close, or a rewind leaving the branch): it is
        removed, unless a seal in it must outlive this Capture (kept for the
        next Capture or dstt gc, said once)."""
        here, self._here = self._here, None
        if here is not None:
            here.close()
        ring, keeper = self.ring, self.keeper
        if ring is None:
            return
        keep = keeper.keeps_uncommitted() if keeper is not None else []
        if keep:
            ring.release()  # (its lock: the next Capture, in this process too, may adopt it)
            log.warning("dstt: steps %s, not committed, stay sealed in %s for the next Capture on branch %r (or "
                        "dstt gc)", keep, ring.dir, self.current.config.branch)
        else:
            ring.close()  # everything sealed is committed, or failed and reported
