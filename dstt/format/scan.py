"""One scan engine: work over tensor data as tasks on any ``concurrent.futures.Executor``.

Every command that reads tensor data (``verify``, ``diff``, ``export
--format zarr``, ``history --metric``, ``run.map``, ``dstt.to_dask``)
splits its work into tasks -- a tensor, a range of its chunks, a step or a
window of steps -- and reduces their results in task order, so the answer
is the same bit for bit whichever executor ran them and in whatever order
they finished.

A task carries only what can travel: the store's URL and
``storage_options`` (:class:`StoreSpec`), names, steps and index entries;
never an open handle. A worker opens the store itself (:func:`opened`,
once per process) and reads with the same bounded, checked reads as every
other read (:mod:`dstt.format.chunks`).

Where tasks run (:func:`scan_executor`):

* ``executor=`` any ``concurrent.futures.Executor`` (a Dask client's
  ``client.get_executor()``, a Ray pool, a ``ProcessPoolExecutor``) -- used
  as given, never shut down here;
* ``"processes"`` (the default): a local process pool, ``workers`` of them
  (``DSTT_WORKERS``; default one per core), started with ``spawn`` (no
  fork of a process holding threads);
* ``"threads"``: a local thread pool; ``"inline"``: this thread;
* ``"dask://HOST:PORT"``: a ``dask.distributed`` cluster (``pip install
  'dstt[dask]'``); ``DSTT_EXECUTOR`` names one of these for every scan.

A scan given no executor and no worker count that is small (under
:data:`SMALL_SCAN_BYTES`) runs inline: starting processes would cost more
than the reading. A store only this process can open (a zarr Store object,
``memory://``) is scanned inline too.

A scan interrupted (Ctrl-C) cancels the tasks not yet started, waits for the
running ones (each bounded: a few chunks) and stops the pool it started;
local workers ignore SIGINT, so the driver alone decides. A worker that
dies fails the scan with :class:`~dstt.errors.ScanError` (a Dask cluster
first retries the task on another worker): never a partial answer.

>>> from operator import mul
>>> run_tasks(mul, [(2, 3), (4, 5)], executor="inline")
[6, 20]
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import signal
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dstt import knobs
from dstt.errors import ConfigError, ScanError

R = TypeVar("R")

#: A scan given neither an executor nor a worker count runs inline below this many bytes.
SMALL_SCAN_BYTES = 256 << 20
#: Bytes of tensor data one task reads, about (tasks of many small tensors are grouped).
TASK_BYTES = 64 << 20
#: Executors by name (``executor=`` / ``--executor`` / ``DSTT_EXECUTOR``), besides ``dask://HOST:PORT``.
LOCAL_KINDS = ("processes", "threads", "inline")
#: Open stores a worker process keeps (:func:`opened`).
OPEN_CACHE = 8
#: How long stopping a pool waits for its running tasks before killing its processes.
STOP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class StoreSpec:
    """What a task needs to open a store in another process: its URL (or
    local path) and fsspec ``storage_options``."""

    url: str
    storage_options: dict[str, Any] = field(default_factory=dict, hash=False)
    #: The store's creation time (its root document): a store removed and
    #: made again at the same URL is another store, never served from a
    #: worker's cache of the old one.
    created: float | None = None

    @classmethod
    def of(cls, reader: Any) -> "StoreSpec | None":
        """The spec of an open reader (a :class:`~dstt.format.index.RunIndex`
        or a Backend), None when another process could not open it (a zarr
        Store object, ``memory://``)."""
        backend = getattr(reader, "backend", reader)
        url = str(getattr(backend, "url", ""))
        protocol = getattr(backend, "protocol", None)
        if not url or protocol == "memory" or url.startswith("memory://"):
            return None
        if type(backend).__name__ == "ZarrStoreBackend":
            return None
        opts = getattr(backend, "storage_options", None) or getattr(reader, "storage_options", None) or {}
        attrs = getattr(reader, "attrs", None)
        created = attrs.get("created") if isinstance(attrs, dict) else None
        return cls(url, dict(opts), created if isinstance(created, (int, float)) else None)


_OPEN: OrderedDict[tuple[Any, str, str, float | None], Any] = OrderedDict()
_OPEN_LOCK = threading.Lock()


def opened(spec: StoreSpec, cls: Callable[..., R]) -> R:
    """``cls(spec.url, storage_options=...)`` (a reader class, or any
    function taking those) opened once per process and kept (the last
    :data:`OPEN_CACHE`): tasks of one scan share it."""
    key = (cls, spec.url, repr(sorted(spec.storage_options.items())), spec.created)
    with _OPEN_LOCK:
        got = _OPEN.get(key)
        if got is not None:
            _OPEN.move_to_end(key)
            return got  # type: ignore[no-any-return]
    made = cls(spec.url, storage_options=spec.storage_options or None)
    attrs = getattr(made, "attrs", None)
    if spec.created is not None and isinstance(attrs, dict) and attrs.get("created") != spec.created:
        from dstt.errors import StoreNotFoundError

        raise StoreNotFoundError(f"{spec.url}: the store was removed and made again since the scan began")
    with _OPEN_LOCK:
        _OPEN[key] = made
        while len(_OPEN) > OPEN_CACHE:
            _OPEN.popitem(last=False)
    return made


def forget_opened() -> int:
    """Close and forget the stores this process opened for tasks (e.g. run
    on every worker before a cluster stops: ``client.run(forget_opened)``);
    how many."""
    with _OPEN_LOCK:
        items = list(_OPEN.values())
        _OPEN.clear()
    for r in items:
        close = getattr(r, "close", None)
        if close is not None:
            close()
    return len(items)


def parse_executor(text: str) -> str:
    """Check an executor name (``processes``, ``threads``, ``inline`` or
    ``dask://HOST:PORT``); ConfigError otherwise."""
    t = text.strip()
    if t in LOCAL_KINDS:
        return t
    if t.startswith(("dask://", "tcp://")):
        host = t.split("://", 1)[1]
        if host and ":" in host:
            return t
    raise ConfigError(f"executor {text!r}: expected {', '.join(LOCAL_KINDS)} or dask://HOST:PORT")


def default_workers() -> int:
    """Workers of the local executor: ``DSTT_WORKERS``, else the cores this process may use."""
    n = knobs.workers()
    if n:
        return n
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _ignore_sigint() -> None:
    """Local workers leave Ctrl-C to the driver (it cancels and stops them)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@dataclass
class Placement:
    """Where one scan runs: an executor (None: inline) and how many tasks to keep in flight."""

    executor: cf.Executor | None
    inflight: int
    kind: str


@contextlib.contextmanager
def scan_executor(executor: Any = None, workers: int | None = None, *, total_bytes: int | None = None,
                  n_tasks: int | None = None, portable: bool = True) -> Iterator[Placement]:
    """The executor a scan runs on (see the module docstring); one this
    function starts is stopped when the block ends."""
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise ConfigError(f"workers must be a positive integer, got {workers!r}")
    if isinstance(executor, cf.Executor):
        yield Placement(executor, 4 * (workers or _slots(executor) or default_workers()), "given")
        return
    if executor is not None and not isinstance(executor, str):
        raise ConfigError(f"executor must be a concurrent.futures.Executor or a name, got {type(executor).__name__}")
    explicit = executor is not None or workers is not None or knobs.executor() is not None
    kind = parse_executor(executor or knobs.executor() or "processes")
    n = workers or default_workers()
    small = not explicit and total_bytes is not None and total_bytes < SMALL_SCAN_BYTES
    if (kind == "inline" or not portable or small or (n_tasks is not None and n_tasks <= 1)
            or (kind != "threads" and not kind.startswith(("dask", "tcp")) and n == 1)):
        yield Placement(None, 1, "inline")
        return
    if kind.startswith(("dask://", "tcp://")):
        with _dask_executor(kind) as (ex, nworkers):
            yield Placement(ex, max(8, 4 * nworkers), "dask")
        return
    if kind == "threads":
        pool: cf.Executor = cf.ThreadPoolExecutor(max_workers=n, thread_name_prefix="dstt-scan")
    else:
        import multiprocessing

        pool = cf.ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context("spawn"),
                                      initializer=_ignore_sigint)
    try:
        yield Placement(pool, 4 * n, kind)
    finally:
        stop_pool(pool)


def stop_pool(pool: cf.Executor, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop a pool this module started: tasks not started are cancelled,
    running ones are waited for at most ``timeout_s`` (each reads a few
    chunks: well under a second), then its worker processes are killed
    (threads cannot be: they are left to finish their one task)."""
    import time

    procs = list((getattr(pool, "_processes", None) or {}).values())  # (shutdown forgets them)
    workers = procs or list(getattr(pool, "_threads", None) or ())
    pool.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + timeout_s
    for w in workers:
        w.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5.0)


@contextlib.contextmanager
def _dask_executor(url: str) -> Iterator[tuple[cf.Executor, int]]:
    try:
        import distributed
        make_client: Any = distributed.Client
    except ImportError:
        raise ConfigError(f"executor {url!r} needs dask.distributed: pip install 'dstt[dask]'") from None
    address = "tcp://" + url.split("://", 1)[1]
    try:
        client = make_client(address, timeout=30, set_as_default=False)
    except (OSError, TimeoutError) as e:
        raise ScanError(f"cannot reach the Dask scheduler at {address}: {e}") from None
    try:
        ex = client.get_executor(pure=False)
        nworkers = _slots(ex) or 1
        try:
            yield ex, nworkers
        finally:
            ex.shutdown(wait=False)
    finally:
        client.close()


def _slots(executor: cf.Executor) -> int | None:
    """Tasks ``executor`` runs at once, where it says: a Dask client's
    executor (its cluster's threads), a local pool (its workers)."""
    client = getattr(executor, "_client", None)
    if client is not None and hasattr(client, "nthreads"):
        try:
            return max(1, int(sum(client.nthreads().values())))
        except Exception:  # noqa: BLE001 - a cluster that cannot say: the default
            return None
    n = getattr(executor, "_max_workers", None)
    return n if isinstance(n, int) and n > 0 else None


def _lost(exc: BaseException) -> ScanError | None:
    """A ScanError for an exception that means a worker or the executor was lost."""
    from concurrent.futures.process import BrokenProcessPool

    if isinstance(exc, BrokenProcessPool):
        return ScanError(f"a scan worker process died ({exc}); nothing partial was returned: run the scan again")
    name = type(exc).__name__
    if name in ("KilledWorker", "FutureCancelledError", "CommClosedError", "CancelledError"):
        return ScanError(f"a scan worker was lost ({name}: {exc}); nothing partial was returned: run the scan again")
    return None


def run_tasks(fn: Callable[..., R], payloads: Sequence[tuple[Any, ...]], *, executor: Any = None,
              workers: int | None = None, weights: Sequence[int] | None = None,
              progress: Callable[[int], None] | None = None, portable: bool = True) -> list[R]:
    """``[fn(*p) for p in payloads]``, run on the scan's executor; results
    in payload order. ``weights`` (bytes per task) decide whether a small
    scan runs inline and drive ``progress(units)``, called as each task
    completes. A DsttError (or any error) a task raised is raised here
    after the remaining tasks are cancelled; a lost worker is a ScanError.
    """
    total = None if weights is None else sum(weights)
    with scan_executor(executor, workers, total_bytes=total, n_tasks=len(payloads), portable=portable) as place:
        if place.executor is None:
            out: list[R] = []
            for k, p in enumerate(payloads):
                out.append(fn(*p))
                if progress is not None:
                    progress(weights[k] if weights is not None else 1)
            return out
        return run_placed(place, fn, payloads, weights, progress)


def run_placed(place: Placement, fn: Callable[..., R], payloads: Sequence[tuple[Any, ...]],
               weights: Sequence[int] | None, progress: Callable[[int], None] | None) -> list[R]:
    """All results of :func:`iter_placed`, in payload order."""
    results: list[Any] = [None] * len(payloads)
    for k, r in iter_placed(place, fn, payloads, weights, progress):
        results[k] = r
    return results


def iter_placed(place: Placement, fn: Callable[..., R], payloads: Sequence[tuple[Any, ...]],
                weights: Sequence[int] | None, progress: Callable[[int], None] | None) -> Iterator[tuple[int, R]]:
    """``(index, fn(*payloads[index]))`` as tasks complete, with at most
    ``place.inflight`` tasks outstanding (memory and Ctrl-C stay bounded);
    everything left is cancelled on any error, interrupt, or when the
    caller stops iterating."""
    if place.executor is None:
        for k, p in enumerate(payloads):
            got = fn(*p)
            if progress is not None:
                progress(weights[k] if weights is not None else 1)
            yield k, got
        return
    pending: dict[cf.Future[R], int] = {}
    todo: deque[int] = deque(range(len(payloads)))
    try:
        while todo or pending:
            while todo and len(pending) < place.inflight:
                k = todo.popleft()
                pending[place.executor.submit(fn, *payloads[k])] = k
            done, _ = cf.wait(list(pending), timeout=1.0, return_when=cf.FIRST_COMPLETED)
            for f in done:
                k = pending.pop(f)
                got = f.result(timeout=0)  # (done: cf.wait said so)
                if progress is not None:
                    progress(weights[k] if weights is not None else 1)
                yield k, got
    except BaseException as exc:
        lost = _lost(exc)
        if lost is not None:
            raise lost from exc
        raise
    finally:
        for f in pending:
            f.cancel()


def groups_by_bytes(sizes: Sequence[int], target: int = TASK_BYTES, min_groups: int = 1) -> list[list[int]]:
    """Consecutive indices of ``sizes`` grouped into runs of about ``target``
    bytes (smaller when that gives fewer than ``min_groups`` groups).

    >>> groups_by_bytes([10, 10, 10, 10], target=20)
    [[0, 1], [2, 3]]
    """
    total = sum(sizes)
    if min_groups > 1 and total:
        target = max(1, min(target, -(-total // min_groups)))
    out: list[list[int]] = []
    size = 0
    for i, s in enumerate(sizes):
        if not out or (size >= target) or (size and size + s > target):
            out.append([])
            size = 0
        out[-1].append(i)
        size += s
    return out


__all__ = ["StoreSpec", "opened", "forget_opened", "parse_executor", "default_workers", "scan_executor", "run_tasks", "run_placed", "iter_placed",
           "groups_by_bytes", "Placement", "SMALL_SCAN_BYTES", "TASK_BYTES"]
