"""Coordination between ranks for planning and committing a step.

Single-process runs use :class:`LocalCoordinator` (no communication). Under
``torch.distributed`` dstt uses its own gloo process groups, so metadata
exchange works beside NCCL training and never interleaves with the
trainer's collectives: one group for the trainer thread (planning), one for
the background committer thread.
"""

from __future__ import annotations

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

    @property
    def distributed(self) -> bool:
        return self.world > 1


class LocalCoordinator(Coordinator):
    pass


class DistCoordinator(Coordinator):
    """Gloo-backed coordination over an existing default process group."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        self._dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def barrier(self) -> None:
        self._dist.barrier(group=self.group)


_DEFAULT: dict[int, DistCoordinator] = {}


def default_coordinator() -> Coordinator:
    """A coordinator for the current process: distributed if a default process
    group exists with more than one rank. Creating it is collective."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return LocalCoordinator()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return LocalCoordinator()
    key = id(dist.group.WORLD)
    if key not in _DEFAULT:
        _DEFAULT[key] = DistCoordinator()
    return _DEFAULT[key]


def new_coordinator() -> Coordinator:
    """A fresh coordinator with its own gloo group (collective call)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return LocalCoordinator()
    return DistCoordinator()


__all__ = ["Coordinator", "LocalCoordinator", "DistCoordinator", "default_coordinator", "new_coordinator"]
