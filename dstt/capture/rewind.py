"""``Capture.rewind``: put the live training objects back to a captured step
-- from the memory tier's host ring when the step is still there, from the
store otherwise -- and continue capturing on a new branch forked at it.

A rewind is an incident too: the ring's steps (the spike that made the
trainer rewind) are stored on the old branch, so the store shows the spike
and the recovery side by side. The new branch needs its fork step stored:
it is opened at the next ``snapshot()`` (or ``close()``), which waits for
that step's commit if it was still in memory only -- the trainer's next
forward and backward overlap that write.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from dstt.capture import rebuilt, rewindpeers
from dstt.capture.config import write_options
from dstt.capture.pipeline import Job
from dstt.errors import BranchExistsError, CaptureError, StepNotFoundError, StepOrderError
from dstt.format import args as A
from dstt.format.geometry import TensorLayout
from dstt.format.layout import StepRef, validate_branch, validate_step
from dstt.store.reader import TensorReader
from dstt.store.state import check_objects
from dstt.store.torch_dtypes import torch_dtype
from dstt.store.writer import Writer
from dstt.timetravel.restore import apply_step, store_read

#: The facade (dstt.capture.engine.Capture), typed loosely: engine imports this module.
Capture = Any

log = logging.getLogger("dstt.capture")


@dataclass
class RingRecord:
    """What :func:`dstt.timetravel.restore.apply_step` needs to know of a step in the ring."""

    step: int
    branch: str
    objects: Any
    by_name: dict[str, TensorLayout]


#: Tensors of the model state: Module.load_state_dict copies them (never keeps them).
MODEL_PREFIX = "model/"


def live_optimizer_state(optimizer: Any, model: Any) -> dict[str, torch.Tensor]:
    """The live optimizer's state tensors by stored name (``optim/<param>/<key>``)."""
    if optimizer is None:
        return {}
    from dstt.store.state import _param_names

    try:
        names = _param_names(optimizer, model)
    except Exception:  # noqa: BLE001 - apply_step reports the mismatch; nothing to reuse
        return {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    out: dict[str, torch.Tensor] = {}
    for name, p in zip(names, params):
        for key, v in optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"optim/{name}/{key}"] = v
    return out


#: Chunks by tensor name: (offset, shape, data).
Parts = rewindpeers.Parts


def ring_reader(job: Job, reuse: dict[str, torch.Tensor] | None = None, more: Parts | None = None) -> Any:
    """Reads the tensors of a staged step out of its slot, into tensors the
    caller owns (an optimizer keeps what it is given; the slot is reused) --
    except the model's, which are handed out as views of the slot while the
    rewind holds it: ``load_state_dict`` copies them. ``reuse``: live
    tensors (the optimizer's state, by name) to copy into where shape and
    dtype match, instead of fresh memory -- read only after the step is
    validated against the live objects, so they are overwritten only when
    the rewind goes ahead; fresh memory would be page-faulted in (slower
    than the copy itself on some machines). ``more``: chunks other ranks'
    rings hold (:func:`dstt.capture.rewindpeers.exchange`)."""
    chunks: Parts = {k: list(v) for k, v in (more or {}).items()}
    for t, view in job.ring.views:
        chunks.setdefault(t.layout.name, []).append((t.offset, t.shape, view))
    return parts_reader(job.plan.step, job.plan.layouts, chunks, reuse)


def parts_reader(step: int, layouts_of: Any, chunks: Parts, reuse: dict[str, torch.Tensor] | None = None) -> Any:
    """Reads the tensors of ``step`` (its ``layouts_of``) out of ``chunks``
    (views the caller keeps alive while it reads): see :func:`ring_reader`."""
    layouts = {l.name: l for l in layouts_of}

    def read(name: str, box: tuple[slice, ...] | None) -> torch.Tensor:
        parts = chunks.get(name)
        if not parts or name not in layouts:
            raise StepNotFoundError(f"tensor {name!r} of step {step} is not in the memory tier")
        layout = layouts[name]
        if len(parts) == 1 and tuple(parts[0][2].shape) == tuple(layout.shape):
            view = parts[0][2]
            if box is None and name.startswith(MODEL_PREFIX):
                return view  # load_state_dict copies it into the module: no copy of our own
            live = (reuse or {}).get(name)
            if (box is None and live is not None and live.shape == view.shape and live.dtype == view.dtype
                    and live.device == view.device and live.is_contiguous()):
                return live.copy_(view)  # the optimizer gets its own tensor back, with the step's values
            whole = view.clone()
        else:
            whole = torch.empty(layout.shape, dtype=torch_dtype(layout.dtype))
            parts = list({tuple(offset): (offset, shape, view) for offset, shape, view in parts}.values())
            if not _covers(parts, tuple(layout.shape), box):
                raise StepNotFoundError(f"tensor {name!r} of step {step} is not whole in the memory tier "
                                        f"({len(parts)} chunk(s) of it for {box or 'all of it'})")
            for offset, shape, view in parts:
                region = tuple(slice(o, o + n) for o, n in zip(offset, shape))
                whole[region].copy_(view.view(whole.dtype) if view.dtype != whole.dtype else view)
        return whole if box is None else whole[box].clone()

    return read


def _covers(parts: list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]], shape: tuple[int, ...],
            box: tuple[slice, ...] | None) -> bool:
    """Whether ``parts`` (chunks of a grid: none overlap) cover ``box`` of a
    tensor of ``shape`` (all of it: None).

    >>> _covers([((0,), (2,), torch.zeros(2)), ((2,), (2,), torch.zeros(2))], (4,), None)
    True
    >>> _covers([((0,), (2,), torch.zeros(2))], (4,), (slice(0, 3),)), _covers([((0,), (2,), torch.zeros(2))], (4,), (slice(0, 2),))
    (False, True)
    """
    want = [(0, n) for n in shape] if box is None else [b.indices(n)[:2] for b, n in zip(box, shape)]
    want += [(0, n) for n in shape[len(want):]]
    total = math.prod(max(0, hi - lo) for lo, hi in want)
    got = sum(math.prod(max(0, min(o + n, hi) - max(o, lo)) for o, n, (lo, hi) in zip(offset, shp, want))
              for offset, shp, _ in parts)
    return got == total


class Rewinder:
    """``rewind`` and the branch switch of a :class:`~dstt.capture.engine.Capture`
    (built once by it; ``cap`` is the facade, whose writer and config a
    switch replaces).

    Phase protocol (all on the trainer's thread):

    1. ``Capture.rewind``: :meth:`rewind` restores the live objects (from
       the committer's memory -- ``Committer.rewind_job`` -- or the store)
       and decides the new branch (:attr:`fork`); ``Committer.after_rewind``
       switches now, or (the memory tier) at the next ``snapshot()``;
    2. ``snapshot()`` and ``close()``: :meth:`switch_if_forked` --
       ``Committer.leave_branch``, the new branch's writer,
       ``Committer.joined_branch``.
    """

    def __init__(self, cap: Capture) -> None:
        self.cap = cap
        #: A rewind's branch (name, fork point, the fork step's job if still in memory), opened at the next snapshot.
        self.fork: tuple[str, StepRef, Job | None] | None = None
        #: (step, branch) of the last rewind until the next snapshot() (its step must follow it).
        self.after: tuple[int, str] | None = None
        #: Where the last rewind's time went, seconds by phase: ``agree`` (every
        #: queued step handed over, the helper's hold, the ranks' agreement),
        #: ``exchange`` (the chunks other ranks' rings hold), ``apply`` (read and
        #: load into the live objects), ``settle`` (the peers read in place
        #: checked), ``done`` (the hold let go of). For
        #: benchmarks/bench_flight.py.
        self.phases: dict[str, float] = {}
        #: The last distributed rewind from memory's chunks of other ranks, in
        #: bytes by how they came: ``mapped`` (read in place from their rings
        #: on this host), ``gloo``, ``again`` (over gloo after a peer let go of
        #: the step while this rank copied it: restored twice). rewindpeers.py.
        self.exchanged: dict[str, int] = {}

    def rewind(
        self,
        step: int,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        rng: bool = True,
        branch: str | None = None,
        strict: bool = True,
        check_steps: bool = True,
    ) -> dict[str, Any]:
        """:meth:`Capture.rewind <dstt.capture.engine.Capture.rewind>` (see its docstring), the Capture open."""
        # Every argument first: a refused rewind changes nothing -- not the
        # live objects, not the store, not the memory tier -- and records no incident.
        validate_step(step)
        if branch is not None:
            validate_branch(branch)
        check_objects(model, optimizer, scheduler, restoring=True)
        A.flag("rng", rng)
        A.flag("strict", strict)
        A.flag("check_steps", check_steps)
        self.cap.raise_pending()
        if self.fork is not None:
            self.switch_branch()  # (an earlier rewind's branch: decided then)
        cur = self.cap.writer
        self._check_new_branch(cur, branch)
        # The live objects are about to change in place: every queued lazy
        # copy must have read them first (what the optimizer hook ensures
        # before an optimizer step), and every queued step be in the ring.
        self.cap.stager.before_optimizer_step()
        clock = time.perf_counter
        t0 = clock()
        job = self.cap.committer.rewind_job(step)  # (the memory tier's: its slot held while it is read)
        self.phases = {"agree": clock() - t0}
        ex: rewindpeers.Exchange | None = None
        try:
            if job is not None:
                rec: Any = RingRecord(step, cur.branch.name, job.plan.tree, {l.name: l for l in job.plan.layouts})
                t0 = clock()
                if self.cap.plan_coord.distributed:
                    ring = self.cap.crashsafe.ring
                    ex = rewindpeers.exchange(job, self.cap.plan_coord, ring.dir if ring is not None else None)
                self.phases["exchange"] = clock() - t0
                read = ring_reader(job, live_optimizer_state(optimizer, model), ex.parts if ex is not None else None)
                where, parent = f"step {step} in the memory tier", StepRef(cur.branch.name, step)
            else:
                rec, read, where, parent = self._rebuilt_step(step, optimizer, model) or self._stored_step(step)
            # A rewind is an incident (the tier's steps are stored on the old
            # branch) -- once the step is known to fit the live objects.
            objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "rng": rng, "strict": strict}
            extra = self._apply(step, rec, read, where, job, ex, objects)
        finally:
            if ex is not None:
                self.exchanged = dict(ex.stats)
                ex.close()
            if job is not None:
                t0 = clock()
                self.cap.committer.rewind_done(job)
                self.phases["done"] = clock() - t0
        name = branch or self._rewind_name(cur, step)
        self.fork = (name, parent, job if job is not None and job.writer is cur else None)
        self.after = (step, name) if check_steps else None
        self.cap.committer.after_rewind()  # (the memory tier switches at the next snapshot)
        log.warning("dstt: rewound to step %d of branch %r; capturing continues on branch %r", step,
                    parent.branch, name)
        return extra

    def _apply(self, step: int, rec: Any, read: Any, where: str, job: Job | None, ex: rewindpeers.Exchange | None,
               objects: dict[str, Any]) -> dict[str, Any]:
        """Restore the live ``objects`` (apply_step's keywords) from ``read``,
        recording the rewind's incident once the step fits them; under
        torch.distributed from memory, with the exchange's settle after it
        (collective: every rank, even one whose restore failed) and, where a
        peer's ring could not be mapped or changed while it was copied, the
        restore (again) from the chunks then sent over gloo. The step's extra."""
        clock = time.perf_counter
        t0 = clock()
        restored, later = False, ex is not None and bool(ex.deferred)
        extra: dict[str, Any] = {}

        def incident() -> None:
            self.cap.committer.rewind_incident(step)

        try:
            if not later:  # (else: a peer's ring it could not map comes over gloo in settle first)
                extra = apply_step(rec, read, where, validated=incident, **objects)
            restored = True
        finally:
            self.phases["apply"] = clock() - t0
            t0 = clock()
            again = rewindpeers.settle(ex, self.cap.plan_coord, restored) if ex is not None else None
            self.phases["settle"] = clock() - t0
        if again is not None and job is not None:  # a peer's ring not mapped, or let go while copied
            read = ring_reader(job, live_optimizer_state(objects["optimizer"], objects["model"]), again)
            extra = apply_step(rec, read, where, validated=incident if later else None, **objects)
        elif later:
            raise CaptureError(f"rewind: step {step}'s chunks of other ranks did not come")  # (settle always sends)
        return extra

    def restore(self, step: int | None, *, model: Any, optimizer: Any, scheduler: Any, rng: bool,
                strict: bool) -> dict[str, Any]:
        """:meth:`Capture.restore <dstt.capture.engine.Capture.restore>` (see its docstring), the Capture open."""
        cur = self.cap.writer
        if step is None:
            if cur.last_step is None:
                raise StepNotFoundError(f"restore: branch {cur.branch.name!r} has no committed step; nothing was "
                                        "changed")
            step = cur.last_step
        validate_step(step)
        check_objects(model, optimizer, scheduler, restoring=True)
        A.flag("rng", rng)
        A.flag("strict", strict)
        self.cap.raise_pending()
        found = self._rebuilt_step(step, optimizer, model) or self._stored_step(step)
        rec, read, where, _ = found
        return apply_step(rec, read, where, model=model, optimizer=optimizer, scheduler=scheduler, rng=rng,
                          strict=strict)

    def check_step(self, step: int) -> None:
        """The first snapshot() after a rewind to step k must be of k + 1
        (issue 29: a loop whose counter ran on mislabelled the new branch's
        steps, and the gap was accepted silently)."""
        rewound = self.after
        if rewound is None:
            return
        k, name = rewound
        if step != k + 1:
            how = "goes backwards" if step <= k else f"skips steps {k + 1}..{step - 1}"
            raise StepOrderError(
                f"snapshot({step}) {how}: branch {name!r} continues from step {k} (the rewind's), so its next "
                f"step is {k + 1}; set the loop's step counter back to the rewound step (step = {k} + 1), or "
                f"rewind(..., check_steps=False) to allow any later step; nothing was captured")
        self.after = None

    @staticmethod
    def _check_new_branch(cur: Writer, branch: str | None) -> None:
        """A rewind continues on a new branch: ``branch`` (when given) must
        not be the branch being captured, nor any branch that exists."""
        if branch is None:
            return
        from dstt.format.root import list_branches

        hint = f"name a new branch, or leave branch= out for {cur.branch.name + '-rewind-<step>'!r}"
        if branch == cur.branch.name:
            raise BranchExistsError(f"rewind: branch {branch!r} is the branch being captured; a rewind continues "
                                    f"on a new branch forked at the step, so the store keeps both ({hint})")
        if branch in list_branches(cur.backend):
            raise BranchExistsError(f"rewind: branch {branch!r} already exists ({hint})")

    def _rebuilt_step(self, step: int, optimizer: Any, model: Any) -> tuple[Any, Any, str, StepRef] | None:
        """(record, reader, description, fork point) of ``step`` from the
        parts of it a distributed recovery rebuilt and kept in memory
        (rebuilt.py: collective, CRC-checked; no store read); None (on every
        rank) where they do not hold all of it."""
        kept = self.cap.crashsafe.rebuilt
        if kept is None or not self.cap.plan_coord.distributed:
            return None
        got = rebuilt.gather(kept, step, self.cap.plan_coord)
        if got is None:
            return None
        cur = self.cap.writer
        rec = RingRecord(step, cur.branch.name, got.tree, {l.name: l for l in got.layouts})
        read = parts_reader(step, got.layouts, got.parts, live_optimizer_state(optimizer, model))
        return rec, read, f"step {step} rebuilt in memory after a node loss", StepRef(cur.branch.name, step)

    def _stored_step(self, step: int) -> tuple[Any, Any, str, StepRef]:
        """(record, reader, description, fork point) of ``step`` in the store,
        after waiting for what is queued to be stored; StepNotFoundError if
        the current branch has no such step (nothing changed then)."""
        self.cap.wait()  # bounded: Capture.wait (background_timeout_s)
        coord = self.cap.plan_coord
        if coord.distributed:  # every rank's wait is over: rank 0's commits of the steps queued are in
            coord.all_gather(step)
        cur = self.cap.writer
        run = TensorReader(cur.backend)
        missing: str | None = None
        try:
            ref = run.resolve(step, branch=cur.branch.name)
        except StepNotFoundError as e:
            missing = str(e)
        if coord.distributed:  # the same answer on every rank: none restores while another raises
            found = coord.all_gather(missing is None)
            if missing is None and not all(found):
                missing = f"rank(s) {', '.join(str(r) for r, f in enumerate(found) if not f)} could not read it"
        if missing is not None:
            note = getattr(self.cap.committer, "rewind_note", "")
            raise StepNotFoundError(f"cannot rewind to step {step}: it is neither in the memory tier"
                                    f"{' of every rank' if coord.distributed else ''} nor stored on branch "
                                    f"{cur.branch.name!r} ({note + '; ' if note else ''}{missing}); nothing was "
                                    "changed") from None
        rec = run.record(ref.step, branch=ref.branch)
        return rec, store_read(run, rec), f"step {ref.step} of branch {ref.branch!r}", StepRef(ref.branch, ref.step)

    @staticmethod
    def _rewind_name(cur: Writer, step: int) -> str:
        from dstt.format.root import list_branches

        taken = set(list_branches(cur.backend))
        base = f"{cur.branch.name}-rewind-{step}"
        name, n = base, 2
        while name in taken:
            name, n = f"{base}-{n}", n + 1
        return name

    def switch_branch(self) -> None:
        """Open the writer of a rewind's branch (its fork step stored first)."""
        assert self.fork is not None
        name, parent, job = self.fork
        self.fork = None
        if job is not None:
            self.cap.ledger.wait_event(job.tier.done, f"step {parent.step} (the fork point of branch {name!r}) "
                              "to be stored")
            if job.tier.decision != "done":
                raise CaptureError(f"rewind: step {parent.step} of branch {parent.branch!r} could not be stored, "
                                   f"so branch {name!r} cannot fork there (see the earlier error)")
        old = self.cap.writer
        cfg = self.cap.config
        self.cap.committer.leave_branch()  # (without the memory tier: everything stored, the old ring let go of)
        new = Writer(self.cap.store_arg, write_options(cfg, branch=name, parent=parent, threads=1),
                     coordinator=self.cap.plan_coord, commit_coordinator=self.cap.commit_coord)
        self.cap.config = replace(cfg, branch=name, parent=None)
        with self.cap.ledger.cond:
            self.cap.writer = new
        self.cap.committer.joined_branch(old)  # (closed; or, with the memory tier, once its steps are stored)

    def switch_if_forked(self) -> None:
        """Open the branch of a rewind decided earlier, if any."""
        if self.fork is not None:
            self.switch_branch()

__all__ = ["Rewinder", "RingRecord", "ring_reader"]
