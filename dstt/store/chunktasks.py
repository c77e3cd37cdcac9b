"""The torch side of a step's chunks: what one rank knows of a tensor
before ranks exchange plans (:class:`LocalTensor`), the chunk tasks viewing
its data (:class:`ChunkTask`, :func:`region_tasks`), and the layout cache
every writer of a process shares. Used by the general plan (plan.py) and
the single-process plan and its memo (planlocal.py)."""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch

from dstt.errors import ShardingError, UnsupportedValueError
from dstt.format.codecs.spec import CodecSpec
from dstt.format.geometry import Region, TensorLayout, build_layout
from dstt.store.shards import ShardedTensor, dtensor_regions, is_dtensor
from dstt.store.torch_dtypes import info_for_torch


@dataclass
class LocalTensor:
    """What this rank knows of one logical tensor before ranks exchange plans."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    mode: str  # "replicated" | "global" (DTensor) | "pieces"
    regions: list[Region]
    data: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)  # offset -> local data

    def describe(self) -> tuple[Any, ...]:
        """Picklable, data-free description exchanged between ranks."""
        return (
            self.kind,
            self.dtype,
            self.shape,
            self.mode,
            [(r.offset, r.shape, tuple(r.holders)) for r in self.regions],
        )


@dataclass(slots=True)
class ChunkTask:
    layout: TensorLayout
    index: int
    coords: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    source: torch.Tensor  # the chunk's box of local data, logical dtype, any device
    #: Bytes of ``source`` (its box, no padding) when the planner knew them
    #: (the single-process plan cache); -1: not given (see ``data_nbytes``).
    data_bytes: int = -1

    @property
    def data_nbytes(self) -> int:
        """Bytes of the chunk's data (its box: edge padding excluded)."""
        n = self.data_bytes
        return n if n >= 0 else math.prod(self.shape) * self.source.element_size()

    @property
    def padded(self) -> bool:
        return self.shape != self.layout.chunk_shape

    @property
    def nbytes(self) -> int:
        return self.layout.chunk_nbytes


def changed_positions(old: list[ChunkTask], new: list[ChunkTask]) -> list[int]:
    """The positions at which two task lists of plans sharing a
    :attr:`StepPlan.layout_key` hold different task objects (those whose
    tensors are new objects: planlocal.py): what a cache keyed on the
    layout redoes (C-level passes, no Python per task).

    >>> a, b, c = (ChunkTask(None, 0, (), (), (), torch.zeros(1)) for _ in range(3))  # type: ignore[arg-type]
    >>> changed_positions([a, b, a], [a, c, a])
    [1]
    """
    return list(itertools.compress(itertools.count(), map(operator.is_not, old, new)))


# ----------------------------------------------------------------------------- local


def describe_local(name: str, kind: str, value: Any, rank: int) -> LocalTensor:
    if is_dtensor(value):
        regions, my_off, local = dtensor_regions(value)
        info = info_for_torch(value.dtype)
        return LocalTensor(name, kind, info.logical, tuple(value.shape), "global", regions, {my_off: local.detach()})
    if isinstance(value, ShardedTensor):
        info = info_for_torch(value.dtype)
        regions = [Region(off, tuple(t.shape), [rank]) for off, t in value.pieces]
        # Empty pieces hold no data, and one may share its offset with a real piece.
        return LocalTensor(name, kind, info.logical, value.shape, "pieces", regions,
                           {off: t.detach() for off, t in value.pieces if t.numel()})
    if isinstance(value, torch.Tensor):
        # Refused here, on the caller's thread, with the tensor's name: these
        # used to fail later with a raw RuntimeError or only in the background.
        # (Cheapest checks first: this runs per tensor per step on the
        # trainer's thread; .device builds an object per call.)
        if value.is_nested:
            raise UnsupportedValueError(f"{name}: nested (ragged) tensors cannot be stored; "
                                        "store their components (.unbind()) instead")
        if value.layout is not torch.strided:  # sparse layouts included
            raise UnsupportedValueError(f"{name}: only dense (strided) tensors can be stored, got {value.layout}")
        if value.is_meta:
            raise UnsupportedValueError(f"{name}: a tensor on the meta device has no data to store")
        info = info_for_torch(value.dtype)
        shape = tuple(value.shape)
        zero = (0,) * len(shape)
        return LocalTensor(name, kind, info.logical, shape, "replicated",
                           [Region(zero, shape, [rank])], {zero: value.detach()})
    raise UnsupportedValueError(f"{name}: not a tensor: {type(value).__name__}")


def region_tasks(layout: TensorLayout, region: Region, data: torch.Tensor, rank: int,
                 held: bool = False) -> list[ChunkTask]:
    """Chunk tasks of one region that ``rank`` owns; ``data`` is the region's local data.
    ``held``: instead, the region's chunks that another of its holders owns
    (``rank`` holds them as a replica: redundancy="replicas")."""
    if math.prod(region.shape) == 0:
        return []
    if held:
        return _region_chunks(layout, region, data, rank, False)
    if layout.chunk_shape == region.shape == layout.shape and len(region.holders) == 1:
        # One chunk, the whole tensor, one holder (most small tensors): no
        # grid walk, and the data itself is the chunk.
        if region.holders[0] != rank:
            return []
        zero = region.offset
        return [ChunkTask(layout, 0, zero, zero, layout.shape, data)]
    return _region_chunks(layout, region, data, rank, True)


def _region_chunks(layout: TensorLayout, region: Region, data: torch.Tensor, rank: int, own: bool,
                   ) -> list[ChunkTask]:
    """Tasks of ``region``'s chunks that ``rank`` owns (``own``) or that another holder owns."""
    tasks = []
    for coords in layout.chunk_grid.overlapping(region.offset, region.shape):
        index = layout.linear(coords)
        if (layout.owner(region, index) == rank) != own:
            continue
        off, shp = layout.chunk_box(coords)
        if off == tuple(region.offset) and shp == tuple(region.shape):
            view = data  # the whole region (a small tensor's one chunk): no view to build
        else:
            view = data[tuple(slice(o - ro, o - ro + n) for o, ro, n in zip(off, region.offset, shp))]
        tasks.append(ChunkTask(layout, index, coords, off, shp, view))
    return tasks


#: Layouts a cache keeps at most (it is cleared when full: a run whose
#: tensors keep changing shape never grows it without bound).
MAX_CACHED_LAYOUTS = 1 << 20
#: Layouts shared by every writer of this process (``dstt.save`` opens a
#: writer per call: 100,000 tensors took ~3 s per call to lay out again).
#: Cleared when it holds more than SHARED_LAYOUTS_MAX (~1-2 KiB each).
_SHARED_LAYOUTS: dict[Any, TensorLayout] = {}
SHARED_LAYOUTS_MAX = 1 << 17


def _cached_layout(name: str, desc: tuple[Any, ...], codec: CodecSpec, max_chunk_bytes: int,
                   pack_chunk_bytes: int | None, cache: dict[Any, TensorLayout] | None) -> TensorLayout:
    if cache is None:
        return build_layout(name, desc, codec, max_chunk_bytes, pack_chunk_bytes)
    kind, dtype, shape, mode, regions = desc
    key = (name, kind, dtype, tuple(shape), mode,
           tuple((tuple(o), tuple(s), tuple(h)) for o, s, h in regions), codec, max_chunk_bytes,
           pack_chunk_bytes)
    layout = cache.get(key)
    if layout is None:
        if len(cache) >= MAX_CACHED_LAYOUTS:
            cache.clear()
        layout = _SHARED_LAYOUTS.get(key)
        if layout is None:
            layout = build_layout(name, desc, codec, max_chunk_bytes, pack_chunk_bytes)
            if len(_SHARED_LAYOUTS) >= SHARED_LAYOUTS_MAX:
                _SHARED_LAYOUTS.clear()
            _SHARED_LAYOUTS[key] = layout
        cache[key] = layout
    return layout


def _local_data_for(lt: LocalTensor, region: Region) -> torch.Tensor:
    if lt.mode == "replicated":
        return next(iter(lt.data.values()))
    data = lt.data.get(region.offset)
    if data is None or tuple(data.shape) != region.shape:
        raise ShardingError(f"{lt.name}: this rank holds no local data for the shard at {region.offset}")
    return data
