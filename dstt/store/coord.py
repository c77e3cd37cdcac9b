"""Coordination between ranks for planning and committing a step.

Single-process runs use :class:`LocalCoordinator` (no communication). Under
``torch.distributed`` dstt uses its own gloo process groups, so metadata
exchange works beside NCCL training and never interleaves with the
trainer's collectives: one group for the trainer thread (planning), one for
the background committer thread.
"""

from __future__ import annotations

import atexit
from typing import Any


class Coordinator:
    rank: int = 0
    world: int = 1

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def gather(self, obj: Any) -> list[Any] | None:
        """Objects of every rank on rank 0, None elsewhere."""
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return obj

    def barrier(self) -> None:
        pass

    def broadcast_tensor(self, tensor: Any, src: int) -> None:
        """Rank ``src``'s ``tensor`` copied into every rank's ``tensor`` (the
        same shape and dtype on every rank), in place, without pickling."""

    def close(self) -> None:
        """Release what the coordinator holds (idempotent)."""

    @property
    def distributed(self) -> bool:
        return self.world > 1


class LocalCoordinator(Coordinator):
    pass


class DistCoordinator(Coordinator):
    """Gloo-backed coordination over an existing default process group.
    Its own group's collectives time out after
    :func:`dstt.knobs.collective_timeout_s` (a rank that died or hangs
    fails the others' dstt call: no wait of torch's default 30 minutes)."""

    def __init__(self, group: Any = None) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        from dstt import knobs

        self._dist = dist
        self.group = group if group is not None else dist.new_group(
            backend="gloo", timeout=timedelta(seconds=knobs.collective_timeout_s()))
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def _group(self) -> Any:
        # None would mean the default group to torch.distributed: never fall back to it.
        if self.group is None:
            raise RuntimeError("dstt coordinator used after close()")
        return self.group

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        self._run("all_gather", lambda: self._dist.all_gather_object(out, obj, group=self._group()))
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        self._run("gather", lambda: self._dist.gather_object(obj, out, dst=0, group=self._group()))
        return out

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self._run("broadcast", lambda: self._dist.broadcast_object_list(box, src=0, group=self._group()))
        return box[0]

    def barrier(self) -> None:
        self._run("barrier", lambda: self._dist.barrier(group=self._group()))

    def broadcast_tensor(self, tensor: Any, src: int) -> None:
        # (``src`` is a rank of the default group: dstt's groups span every rank)
        self._run("broadcast", lambda: self._dist.broadcast(tensor, src=src, group=self._group()))

    def _run(self, name: str, op: Any) -> None:
        """``op()``, a collective of this group; a failure of it (a rank that
        died, or did not come within the group's timeout) as a CaptureError."""
        from dstt.errors import CaptureError, DsttError

        try:
            op()
        except DsttError:
            raise
        except RuntimeError as e:
            raise CaptureError(f"dstt's {name} across {self.world} ranks failed on rank {self.rank}: a rank died "
                               f"or did not join it within DSTT_COLLECTIVE_TIMEOUT_S: {str(e)[:300]}") from e

    def close(self) -> None:
        """Drop this coordinator's reference to its process group.

        The group stays registered with torch.distributed and is torn down
        with the others by ``destroy_process_group()``. What must not happen
        is that dstt holds the last reference past that: a gloo group freed
        during interpreter finalization (an unclosed Capture kept alive by a
        reference cycle or a traceback) can abort the process at exit with
        "terminate called without an active exception".
        """
        self.group = None


# The coordinator dstt.save uses under torch.distributed, for the current
# default process group: creating a group is collective and slow, so it is
# made once per default group, and replaced when the default group changes.
_DEFAULT: list[tuple[Any, DistCoordinator]] = []


@atexit.register
def _release_default() -> None:
    while _DEFAULT:
        _DEFAULT.pop()[1].close()


def default_coordinator() -> Coordinator:
    """A coordinator for the current process: distributed if a default process
    group exists with more than one rank. Creating it is collective."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return LocalCoordinator()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        _release_default()
        return LocalCoordinator()
    world = dist.group.WORLD
    if not _DEFAULT or _DEFAULT[0][0] is not world:
        _release_default()
        _DEFAULT.append((world, DistCoordinator()))
    return _DEFAULT[0][1]


def new_coordinator() -> Coordinator:
    """A fresh coordinator with its own gloo group (collective call)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return LocalCoordinator()
    return DistCoordinator()


__all__ = ["Coordinator", "LocalCoordinator", "DistCoordinator", "default_coordinator", "new_coordinator"]
