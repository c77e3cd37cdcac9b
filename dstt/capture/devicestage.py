"""Device staging: a step's GPU sources copied on the GPU first.

The trainer's stall for a step of CUDA state was the stager's issuing of
its device-to-host copies: the optimizer pre-hook waits until every copy is
enqueued, and a copy into host memory that is not page-locked yet (the
first steps, while the pool is registered with CUDA in the background:
hostpool.py) runs synchronously at the speed of fresh host pages. Measured
on an H100: the first ``snapshot()`` stalled 14-66x one pinned copy of the
state, the later ones 0.11x.

Here, inside ``snapshot()`` on the trainer's thread, every lazy source of a
step is copied into one flat scratch tensor per (device, dtype) on the GPU
(``torch._utils._flatten_dense_tensors``: one launch per group, on the
current stream, so the optimizer's kernels queue behind it in stream order
and the host waits for nothing), and the stager copies the scratch to the
host in the background at whatever speed the host allows. The step is the
state as of ``snapshot()`` exactly as before: the scratch is written in
stream order after the state's last change and before the next one.

Used only where it cannot cost the trainer memory it needs: the device must
have room for the scratch above the most this process has had allocated so
far (its training peak) plus a margin (:data:`MARGIN_FRACTION` of the
device, at least :data:`MARGIN_MIN_BYTES`), and at most
:data:`MAX_IN_FLIGHT` steps hold scratch at once (a step's scratch is freed
when its host copies landed). ``DSTT_DEVICE_STAGING=off`` turns it off.

Phase protocol (who calls what, on which thread):

1. trainer, ``snapshot()`` (the stager's ``queue_lazy``):
   :meth:`DeviceStaging.take` -- the copies on the GPU, ``job.early`` set,
   ``job.issued`` set, the mutation guard released (nothing reads the live
   sources any more);
2. stager thread: ``Stager.stage`` copies ``job.early[i]`` instead of
   ``job.lazy[i].source``; then :meth:`DeviceStaging.done` drops the
   scratch (its copies have landed: the stager waited for them);
3. trainer, the optimizer pre-hook: returns at once for such a job.
"""

from __future__ import annotations

import logging
import operator
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch

from dstt import knobs
from dstt.capture.pipeline import Job
from dstt.store.plan import ChunkTask

log = logging.getLogger("dstt.capture")

#: Steps whose scratch may be alive at once (one being copied to the host,
#: one waiting for the stager).
MAX_IN_FLIGHT = 2
#: Memory kept free on the device beyond the process's peak and the scratch.
MARGIN_FRACTION = 0.05
MARGIN_MIN_BYTES = 1 << 30
#: Lazy sources in host memory (a step's CPU scalars, e.g. Adam's ``step``)
#: are cloned alongside, up to this many bytes; above it the step takes the
#: usual path.
CPU_MAX_BYTES = 16 << 20


@dataclass(frozen=True)
class StagingLayout:
    """Where each lazy task of a step goes in the flat copies: a pure
    function of the task list (the same task objects step after step while
    the plan memo hits, so it is computed once)."""

    tasks: tuple[ChunkTask, ...]
    #: Per (device, dtype) group: the indices of its tasks.
    groups: tuple[tuple[int, ...], ...]
    #: Per task: (group, first element, elements, shape).
    where: tuple[tuple[int, int, int, torch.Size], ...]
    device_bytes: dict[torch.device, int]
    cpu_bytes: int
    #: Why no step of this task list can be staged on the device (None: it can).
    unfit: str | None = None

    @classmethod
    def of(cls, tasks: list[ChunkTask]) -> StagingLayout:
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        device_bytes: dict[torch.device, int] = {}
        cpu_bytes = 0
        unfit = None
        for i, t in enumerate(tasks):
            src = t.source
            n = src.numel() * src.element_size()
            if src.is_cuda:
                device_bytes[src.device] = device_bytes.get(src.device, 0) + n
            elif src.is_cpu:
                cpu_bytes += n
            else:
                unfit = f"a source on {src.device}"
            groups.setdefault((src.device, src.dtype), []).append(i)
        if not device_bytes:
            unfit = unfit or "no source on a GPU"
        elif cpu_bytes > CPU_MAX_BYTES:
            unfit = unfit or f"{cpu_bytes} bytes of lazy sources in host memory"
        where: list[tuple[int, int, int, torch.Size]] = [(0, 0, 0, torch.Size())] * len(tasks)
        for g, idxs in enumerate(groups.values()):
            at = 0
            for i in idxs:
                src = tasks[i].source
                where[i] = (g, at, src.numel(), src.shape)
                at += src.numel()
        return cls(tuple(tasks), tuple(tuple(v) for v in groups.values()), tuple(where), device_bytes, cpu_bytes,
                   unfit)

    def same_tasks(self, tasks: list[ChunkTask]) -> bool:
        return len(tasks) == len(self.tasks) and all(map(operator.is_, tasks, self.tasks))


class EarlyCopies(Sequence[torch.Tensor]):
    """A step's lazy sources as copied on their devices: the flat copies
    and, asked for task ``i`` (stager thread), a view of its part shaped as
    its source."""

    def __init__(self, layout: StagingLayout, flats: list[torch.Tensor]) -> None:
        self.layout = layout
        self.flats = flats

    def __len__(self) -> int:
        return len(self.layout.where)

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[torch.Tensor]: ...

    def __getitem__(self, i: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        if isinstance(i, slice):
            return [self[k] for k in range(len(self))[i]]
        g, at, n, shape = self.layout.where[i]
        return self.flats[g][at: at + n].view(shape)


class DeviceStaging:
    """Copies a step's lazy sources on their devices at ``snapshot()``.

    A component of the :class:`~dstt.capture.stager.Stager` (see the module
    docstring for the protocol).
    """

    def __init__(self, mark: Callable[[set[torch.device]], dict[int, Any]]) -> None:
        #: Records an event on each device's current stream and returns them
        #: by device index (``CudaCopier.after_compute``): what the host
        #: copies of the scratch wait for.
        self._mark = mark
        self._lock = threading.Lock()
        self._live: list[Job] = []  # jobs whose scratch is alive
        self._said: set[str] = set()
        self._layout: StagingLayout | None = None  # the last step's
        #: Steps copied on the device first so far (tests, benchmarks).
        self.steps = 0

    @staticmethod
    def enabled() -> bool:
        return knobs.device_staging() != "off"

    def in_flight(self) -> int:
        with self._lock:
            self._live = [j for j in self._live if j.early is not None]
            return len(self._live)

    def layout(self, tasks: list[ChunkTask]) -> StagingLayout:
        """The staging layout of ``tasks`` (the last one again when the
        plan reused its tasks)."""
        last = self._layout
        if last is None or not last.same_tasks(tasks):
            last = self._layout = StagingLayout.of(tasks)
        return last

    def take(self, job: Job) -> bool:
        """Copy ``job``'s lazy sources on their devices now (trainer thread,
        inside ``snapshot()``); False where the step takes the usual path."""
        if not job.lazy or job.error is not None or not self.enabled() or self.in_flight() >= MAX_IN_FLIGHT:
            return False
        layout = self.layout(job.lazy)
        if layout.unfit is not None:
            return False
        for dev, n in layout.device_bytes.items():
            if not self._room(dev, n):
                return False
        try:
            with torch.no_grad():  # (a parameter's copy is data, never part of the trainer's graph)
                flats = copy_flat(job.lazy, layout)
        except torch.OutOfMemoryError:
            self._say("oom", "dstt: no device memory for staging a step on the GPU; it is copied to the host directly")
            return False
        except RuntimeError as e:  # (nothing was changed yet: the step takes the usual path, which says what is wrong)
            self._say("error", f"dstt: staging a step on the GPU failed ({e}); steps are copied to the host directly")
            return False
        # The host copies read the scratch once the copies above ran: mark
        # that point in each device's current stream (they wait for it).
        job.ready.update(self._mark(set(layout.device_bytes)))
        if job.guard is not None:
            job.guard.release()  # nothing reads the live sources any more
            job.guard = None
        job.early = EarlyCopies(layout, flats)
        job.device_staged = True
        with self._lock:
            self._live.append(job)
            self.steps += 1
        job.issued.set()
        return True

    @staticmethod
    def done(job: Job) -> None:
        """The host copies of ``job`` landed (stager thread): drop its scratch."""
        job.early = None

    @staticmethod
    def _room(dev: torch.device, nbytes: int) -> bool:
        """Whether ``nbytes`` of scratch on ``dev`` leave the trainer the most
        it has ever had allocated, and a margin."""
        idx = _index(dev)
        free, total = torch.cuda.mem_get_info(idx)
        allocated, peak, reserved = _allocator_bytes(idx)  # (reserved: free to reuse within this process)
        margin = max(MARGIN_MIN_BYTES, int(total * MARGIN_FRACTION))
        return max(peak, allocated) + nbytes + margin <= free + reserved

    def _say(self, key: str, text: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning(text)


def copy_flat(tasks: list[ChunkTask], layout: StagingLayout) -> list[torch.Tensor]:
    """Each group's sources copied into one flat tensor (on the current
    stream of their device): one launch per group."""
    flats = []
    for idxs in layout.groups:
        srcs = [tasks[i].source for i in idxs]
        if len(srcs) == 1:  # (flatten_dense_tensors returns a lone contiguous tensor itself, not a copy)
            flats.append(srcs[0].clone(memory_format=torch.contiguous_format).view(-1))
        else:
            flats.append(torch._utils._flatten_dense_tensors(srcs))  # type: ignore[no-untyped-call]
    return flats


def _allocator_bytes(idx: int) -> tuple[int, int, int]:
    """The caching allocator's bytes allocated now, at most so far, and
    reserved, on device ``idx``: one call (``torch.cuda.memory_allocated``
    and its kin build the whole flat statistics dictionary each, ~0.2 ms)."""
    try:
        stats: Any = torch._C._cuda_memoryStats(idx)
        alloc, res = stats["allocated_bytes"]["all"], stats["reserved_bytes"]["all"]
        return int(alloc["current"]), int(alloc["peak"]), int(res["current"])
    except (AttributeError, KeyError, TypeError):  # (another torch: the public calls)
        return (torch.cuda.memory_allocated(idx), torch.cuda.max_memory_allocated(idx),
                torch.cuda.memory_reserved(idx))


def _index(dev: torch.device) -> int:
    return dev.index if dev.index is not None else torch.cuda.current_device()


__all__ = ["DeviceStaging", "EarlyCopies", "StagingLayout", "copy_flat"]
