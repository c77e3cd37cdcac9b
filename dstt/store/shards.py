"""Sharded logical tensors: where each piece of a tensor lives.

A logical tensor is described by its global shape and a list of *regions*
(box offset + shape) that tile it exactly, each held by one or more ranks.
Three inputs produce regions:

* a plain tensor -- one region; under torch.distributed it is assumed
  replicated on every rank that passes it;
* a DTensor (FSDP2, tensor parallel) -- regions follow its placements with
  ``torch.chunk`` semantics (uneven shards and empty shards included);
* a :class:`ShardedTensor` -- explicit local pieces with global offsets.

Regions and the rules they follow (they tile the tensor exactly) are torch-free:
:mod:`dstt.format.geometry`.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any, Iterable, Sequence

import torch

from dstt.errors import ShardingError
from dstt.format.geometry import Box, Region


class ShardedTensor:
    """One logical tensor given as local pieces with global offsets.

    >>> full = torch.arange(10.0)
    >>> st = ShardedTensor((10,), [((0,), full[:3]), ((3,), full[3:])])
    >>> st.shape, st.dtype
    ((10,), torch.float32)
    """

    def __init__(
        self,
        global_shape: Sequence[int],
        pieces: Iterable[tuple[Sequence[int], torch.Tensor]],
    ) -> None:
        self.shape = tuple(int(s) for s in global_shape)
        if any(s < 0 for s in self.shape):
            raise ShardingError(f"global shape {self.shape} has a negative size")
        self.pieces: list[tuple[tuple[int, ...], torch.Tensor]] = []
        dtype = None
        for offset, data in pieces:
            if not isinstance(data, torch.Tensor):
                raise ShardingError(f"a shard must be a torch.Tensor, got {type(data).__name__}")
            off = tuple(int(o) for o in offset)
            if len(off) != len(self.shape) or data.dim() != len(self.shape):
                raise ShardingError(
                    f"shard of rank {data.dim()} at offset {off} does not match global shape {self.shape}"
                )
            for d, (o, n, s) in enumerate(zip(off, data.shape, self.shape)):
                if o < 0 or o + n > s:
                    raise ShardingError(
                        f"shard at offset {off} with shape {tuple(data.shape)} falls outside "
                        f"global shape {self.shape} (dim {d})"
                    )
            if dtype is not None and data.dtype != dtype:
                raise ShardingError(f"shards mix dtypes {dtype} and {data.dtype}")
            dtype = data.dtype
            self.pieces.append((off, data))
        if dtype is None:
            raise ShardingError("a ShardedTensor needs at least one piece")
        self.dtype = dtype

    @classmethod
    def from_piece(cls, local: torch.Tensor, offset: Sequence[int], global_shape: Sequence[int]) -> "ShardedTensor":
        """A single local piece: what one rank holds of a larger tensor."""
        return cls(global_shape, [(offset, local)])

    def __repr__(self) -> str:
        return f"ShardedTensor(shape={self.shape}, dtype={self.dtype}, pieces={len(self.pieces)})"


def is_dtensor(v: Any) -> bool:
    if type(v) is torch.Tensor or isinstance(v, ShardedTensor):
        return False  # the common case, without an import per tensor (issue 16)
    if "torch.distributed.tensor" not in sys.modules:
        return False  # no DTensor can exist yet: importing it costs ~0.7 s (issue 16)
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(v, DTensor)


def _chunk_bounds(n: int, k: int, i: int) -> tuple[int, int]:
    """torch.chunk / DTensor Shard semantics: piece i of k over n elements."""
    c = -(-n // k) if k else n
    start = min(i * c, n)
    return start, min(start + c, n) - start


def dtensor_regions(t: Any) -> tuple[list[Region], tuple[int, ...], torch.Tensor]:
    """Global regions of a DTensor, the local region's offset and local data."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = t.device_mesh
    placements = t.placements
    shape = tuple(t.shape)
    mesh_ranks = mesh.mesh
    regions: dict[Box, Region] = {}
    my_rank = torch.distributed.get_rank()
    my_offset: tuple[int, ...] | None = None
    for coord in itertools.product(*(range(s) for s in mesh_ranks.shape)):
        off = [0] * len(shape)
        size = list(shape)
        for mdim, p in enumerate(placements):
            if type(p) is Shard:
                d = p.dim
                start, n = _chunk_bounds(size[d], mesh_ranks.shape[mdim], coord[mdim])
                off[d] += start
                size[d] = n
            elif not isinstance(p, Replicate):
                raise ShardingError(
                    f"cannot store a DTensor with placement {p!r}; "
                    "supported: Shard and Replicate (redistribute Partial first)"
                )
        rank = int(mesh_ranks[coord])
        box = (tuple(off), tuple(size))
        regions.setdefault(box, Region(box[0], box[1])).holders.append(rank)
        if rank == my_rank:
            my_offset = box[0]
    local = t.to_local()
    if my_offset is None:
        raise ShardingError("this rank is not part of the DTensor's device mesh")
    return list(regions.values()), my_offset, local
