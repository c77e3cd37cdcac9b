"""The synchronous top-level API: ``dstt.save``, ``dstt.open`` and
:class:`Run`, what ``dstt.open`` returns, ``dstt.gc`` and ``dstt.resume``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from dstt.format.codecs.keyframes import DEFAULT_KEYFRAME_EVERY
from dstt.format.gc import GcReport
from dstt.format.incidents import Incident
from dstt.format.layout import validate_step
from dstt.format.refs import StepRef
from dstt.format.writeoptions import WriteOptions
from dstt.store.reader import TensorReader
from dstt.store.writer import Writer

if TYPE_CHECKING:  # (defined there; dstt.store.writer returns it)
    from dstt.format.commit import CommitInfo


class Run(TensorReader):
    """A captured run, opened read-only: branches, steps, tensors (torch),
    the nested state, and the analysis queries (diff, history, find).

    >>> import tempfile, torch, dstt
    >>> path = tempfile.mkdtemp() + "/run"
    >>> _ = dstt.save(path, 0, {"model": {"w": torch.arange(4.0)}})
    >>> run = dstt.open(path)
    >>> run.steps()
    [0]
    >>> run.read("model/w", 0)
    tensor([0., 1., 2., 3.])
    """

    def diff(self, a: Any, b: Any, patterns: Any = None, **kw: Any) -> list[dict[str, Any]]:
        """Per-tensor diff rows between two points; see :func:`dstt.analysis.diff.diff`."""
        from dstt.analysis.diff import diff

        return diff(self, a, b, patterns, **kw)

    def history(self, names: Any, stat: str = "norm", branch: str | None = None, **kw: Any) -> list[dict[str, Any]]:
        """A stat across steps from the step index; see :func:`dstt.analysis.history.history`."""
        from dstt.analysis.history import history

        return history(self, names, stat=stat, branch=branch, **kw)

    def map(self, fn: Any, names: Any = "*", steps: Any = None, branch: str | None = None,
            **kw: Any) -> list[dict[str, Any]]:
        """``fn(tensor)`` of every matching (tensor, step), in parallel, as
        rows ``{"tensor", "branch", "step", "value"}``; ``fn`` may be a metric
        name (``"sparsity"``, ``"spectral_norm"``, ...); ``executor=`` and
        ``workers=`` choose where it runs. See
        :func:`dstt.analysis.metrics.map_tensors`."""
        from dstt.analysis.metrics import map_tensors

        return map_tensors(self, fn, names, steps, branch, **kw)

    def find(self, patterns: Any = None, branch: str | None = None, **kw: Any) -> list[dict[str, Any]]:
        """The first step where something went wrong (NaN/Inf, a norm jump, a stat threshold),
        from the step index; see :func:`dstt.analysis.anomaly.find`."""
        from dstt.analysis.anomaly import find

        return find(self, patterns, branch, **kw)

    def incidents(self, branch: str | None = None) -> list[Incident]:
        """The incidents recorded in the store (``cap.incident(reason)``,
        automatic ones on NaN/Inf values, rewinds), of ``branch`` or of every
        branch, sorted by (branch, step, time). Each is a
        :class:`dstt.format.incidents.Incident`: ``branch``, ``step``,
        ``reason``, ``source`` (``"trainer"``, ``"non-finite"``,
        ``"rewind"``), ``time``, ``steps`` (the memory ring's steps persisted
        because of it) and ``tensors`` (the non-finite ones). A damaged
        record is skipped with a logged warning. Which steps were captured
        and which persisted: :meth:`captured`.

        >>> import tempfile, torch, dstt
        >>> from dstt.format.incidents import Incident, record_incident
        >>> path = tempfile.mkdtemp() + "/run"
        >>> _ = dstt.save(path, 7, {"w": torch.ones(1)})
        >>> run = dstt.open(path)
        >>> _ = record_incident(run.backend, Incident("main", 7, "loss spike", "trainer", 1.0e9, (6, 7)))
        >>> [(i.step, i.source, i.reason, i.steps) for i in run.incidents()]
        [(7, 'trainer', 'loss spike', (6, 7))]
        >>> run.captured()  # (captured spans, persisted steps)
        ([(7, 7)], [7])
        """
        from dstt.format.incidents import list_incidents

        return list_incidents(self.backend, branch)


def save(
    store: Any,
    step: int,
    state: Any,
    *,
    branch: str = "main",
    allow_pickle: bool = False,
    compression: str = "none",
    parent: StepRef | tuple[str, int] | str | None = None,
    storage_options: dict[str, Any] | None = None,
    keyframe_every: int = DEFAULT_KEYFRAME_EVERY,
) -> CommitInfo:
    """Save ``state`` as ``step`` of ``branch``, durably and atomically.

    ``state`` is a nested dict of tensors (plain, DTensor or
    :class:`dstt.ShardedTensor`) and plain values, e.g. what
    :func:`dstt.state_of` builds. Under torch.distributed every rank calls it;
    each writes its own shards and rank 0 commits. ``parent`` (for a new
    branch) is a :class:`dstt.StepRef`, a ``(branch, step)`` pair or a
    reference such as ``"main:1200"``. ``storage_options`` go to fsspec for
    URLs such as ``s3://`` (docs/object-stores.md). ``compression``:
    ``"none"``, ``"zstd"``, ``"shuffle-zstd"`` or ``"delta"`` (each chunk
    stored as its difference to the same chunk's keyframe when that is
    smaller; a keyframe at least every ``keyframe_every`` steps:
    docs/format.md "Delta chunks").

    >>> import tempfile, torch, dstt
    >>> path = tempfile.mkdtemp() + "/run"
    >>> info = dstt.save(path, 0, {"model": {"w": torch.ones(2)}, "lr": 0.1})
    >>> info.n_tensors, dstt.open(path).state_dict(0)["lr"]
    (1, 0.1)
    """
    validate_step(step)  # before the writer opens, locks or creates anything (its own arguments: Writer)
    options = WriteOptions(branch=branch, parent=parent, allow_pickle=allow_pickle, compression=compression,
                           storage_options=storage_options, keyframe_every=keyframe_every)
    with Writer(store, options) as w:
        w.flusher.prev_values.budget = 0  # one step: no next step here to take its values (no copy on the caller's thread)
        return w.write(step, state)


def gc(store: Any, *, dry_run: bool = False, progress: Callable[[str], None] | None = None) -> GcReport:
    """Commit what dead trainers left sealed in staging rings on this host,
    or recorded by every rank in the store (``committed`` in the report:
    capture/salvage.py), then remove the chunks and arrays no committed
    step references and uncommitted step directories
    (:func:`dstt.format.gc.collect_garbage`; docs/timetravel.md). The one gc
    path: ``dstt gc`` runs this, so the API is never less safe than the
    command. Refuses to run beside a live writer (StoreLockedError).

    >>> import tempfile, torch, dstt
    >>> path = tempfile.mkdtemp() + "/run"
    >>> for s in range(3):
    ...     _ = dstt.save(path, s, {"w": torch.full((4,), float(s))})
    >>> _ = dstt.prune(path, keep_last=1)
    >>> report = dstt.gc(path)
    >>> report.chunks_removed, report.committed
    (2, {})
    """
    from dstt.capture.collect import gc as collect

    return collect(store, dry_run=dry_run, progress=progress)


def open(store: Any, *, storage_options: dict[str, Any] | None = None) -> Run:  # noqa: A001 - mirrors zarr.open
    """Open a store (path, URL or zarr Store) read-only; ``storage_options``
    go to fsspec for URLs such as ``s3://`` (docs/object-stores.md).

    >>> import tempfile, torch, dstt
    >>> path = tempfile.mkdtemp() + "/run"
    >>> _ = dstt.save(path, 5, {"w": torch.zeros(1)})
    >>> dstt.open(path).steps()
    [5]
    """
    return Run(store, storage_options=storage_options)


class Resumed(NamedTuple):
    """What :func:`resume` gives back: the restored step's ``extra`` (where a
    loop keeps its data position), the step restored, the step to train
    next (``step + 1``), and the Capture that continues on the right branch
    (None with ``capture=False``)."""

    extra: dict[str, Any]
    step: int
    next_step: int
    capture: Any


def resume(ref: Any, *, model: Any = None, optimizer: Any = None, scheduler: Any = None, rng: bool = True,
           branch: str | None = None, strict: bool = True, capture: bool = True,
           **capture_options: Any) -> Resumed:
    """Resume a plain training loop from ``ref`` (``STORE[@BRANCH][:STEP]``):
    restore ``model``/``optimizer``/``scheduler``/RNG to the step (all or
    nothing, as :func:`dstt.restore`), and open the Capture that goes on
    capturing it -- on the same branch when ``ref`` is its latest step,
    else on ``branch`` (a new branch forked at the step: committed steps are
    never overwritten; ConfigError without one). ``capture_options`` go to
    :class:`dstt.Capture`. Every argument is checked before anything is
    restored.

    >>> import tempfile, torch, dstt
    >>> path = tempfile.mkdtemp() + "/run"
    >>> m = torch.nn.Linear(2, 1)
    >>> for s in range(3):
    ...     _ = dstt.save(path, s, dstt.state_of(model=m, extra={"pos": 32 * s}))
    >>> r = dstt.resume(f"{path}:1", model=m, branch="retry")
    >>> r.extra, r.next_step
    ({'pos': 32}, 2)
    >>> with r.capture as cap:
    ...     _ = cap.snapshot(r.next_step, model=m)
    >>> dstt.open(path).steps("retry"), dstt.open(path).branch_info("retry").parent
    ([2], StepRef(branch='main', step=1))
    """
    from dstt.capture import Capture
    from dstt.integrations import resume_target
    from dstt.timetravel.restore import restore

    store, target, step, parent = resume_target(ref, branch)
    if parent is not None:
        from dstt.errors import BranchExistsError
        from dstt.format.backends import open_backend
        from dstt.format.root import list_branches

        if target in list_branches(open_backend(store, create=False)):
            raise BranchExistsError(f"resume: branch {target!r} already exists; name a new branch to fork at "
                                    f"step {step} (committed steps are never overwritten)")
    extra = restore(f"{store}@{parent[0] if parent else target}:{step}", model=model, optimizer=optimizer,
                    scheduler=scheduler, rng=rng, strict=strict)
    cap = Capture(store, branch=target, parent=parent, **capture_options) if capture else None
    return Resumed(extra, step, step + 1, cap)
