"""The pure geometry of a logical tensor in a store (torch-free format layer).

A *logical tensor* is one named tensor of a step, however many ranks hold
pieces of it. Its layout -- :class:`LogicalTensor`: name, kind, dtype, shape,
chunk shape and codec, the one definition of these fields -- is shared by a
tensor being planned (:class:`TensorLayout`, which adds the shard regions
that tile it) and a committed one (:class:`dstt.format.entries.TensorEntry`,
which adds where its chunks are). Everything here is a pure function of its
inputs, so every rank computes the same layout without talking to the others:

* :class:`ChunkGrid`: the regular chunk grid (C order; edge chunks padded);
* :class:`Region`, :func:`check_tiling`, :func:`interior_boundaries`: boxes
  of the tensor and the ranks that hold them, which must tile it exactly;
* :func:`choose_chunk_shape`: the largest chunks whose edges fall on every
  shard boundary, so each stored chunk has exactly one writer (Megatron-LM
  #1053 lost optimizer state when two ranks wrote one chunk);
* :func:`build_layout`: a tensor's :class:`TensorLayout` from its global
  description (what ``dstt.store.plan`` gathers from the ranks).

>>> from dstt.format.codecs.spec import CodecSpec
>>> l = build_layout("w", ("tensor", "float32", (10, 4), "pieces",
...                         [((0, 0), (4, 4), (0,)), ((4, 0), (2, 4), (1,)), ((6, 0), (4, 4), (2,))]),
...                  CodecSpec(), 64 << 20, 0)
>>> l.chunk_shape, l.nchunks, l.array
((2, 4), 5, 'tensors/w/@float32_10x4_c2x4_raw')
>>> [l.owner(r, 0) for r in l.regions]
[0, 1, 2]
"""

from __future__ import annotations

import itertools
import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterator, TypeVar, overload

from dstt import knobs
from dstt.errors import ShardingError
from dstt.format.codecs.delta import DELTA_ITEMSIZES
from dstt.format.codecs.spec import CodecSpec
from dstt.format.dtypes import DtypeInfo, info_for_name
from dstt.format.layout import DELTA_SUFFIX, array_path

_T = TypeVar("_T")

#: The largest chunk a tensor is split into, in bytes (a step's plan: store/plan.py).
DEFAULT_MAX_CHUNK_BYTES = 64 << 20

#: A box of a tensor: (offset, shape).
Box = tuple[tuple[int, ...], tuple[int, ...]]


class cached(Generic[_T]):  # noqa: N801 - used as a decorator, like functools.cached_property
    """A computed-once attribute without functools.cached_property's lock
    (Python 3.11 takes it on the first use per instance, which cost more
    than the values for tens of thousands of one-chunk tensors: issue 16).
    The value lands in the instance ``__dict__``, which wins from then on
    (so a producer may also put an equal value there first). A race
    computes a pure value twice, harmlessly."""

    def __init__(self, fn: Callable[[Any], _T]) -> None:
        self.fn = fn
        self.name = fn.__name__

    @overload
    def __get__(self, obj: None, cls: Any) -> cached[_T]: ...
    @overload
    def __get__(self, obj: object, cls: Any) -> _T: ...
    def __get__(self, obj: Any, cls: Any) -> Any:
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.fn(obj)
        return value


# ----------------------------------------------------------------------------- the chunk grid


@dataclass(frozen=True)
class ChunkGrid:
    """The regular chunk grid of a tensor: chunk ``i`` (C order over the
    grid) covers ``region(i)``; edge chunks are padded to ``chunk_shape``.

    >>> g = ChunkGrid((5, 3), (2, 3))
    >>> g.grid, g.nchunks, g.coords(2), g.region(2)
    ((3, 1), 3, (2, 0), (slice(4, 5, None), slice(0, 3, None)))
    """

    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]

    # grid and nchunks are computed once, at construction: asked several
    # times per chunk, and functools.cached_property takes a lock on first
    # use of each instance (Python 3.11), which cost more than the value
    # for tens of thousands of one-chunk tensors (issue 16).
    def __post_init__(self) -> None:
        grid = tuple(-(-s // c) if s else 0 for s, c in zip(self.shape, self.chunk_shape))
        object.__setattr__(self, "grid", grid)
        object.__setattr__(self, "nchunks", math.prod(grid))

    grid: tuple[int, ...] = field(init=False, repr=False, compare=False)  # chunks along each dimension
    nchunks: int = field(init=False, repr=False, compare=False)

    @property
    def chunk_numel(self) -> int:
        """Elements of a (padded) chunk."""
        return math.prod(self.chunk_shape)

    def coords(self, index: int) -> tuple[int, ...]:
        """Grid coordinates of chunk ``index``."""
        out = []
        for g in reversed(self.grid):
            out.append(index % g)
            index //= g
        return tuple(reversed(out))

    def index(self, coords: tuple[int, ...]) -> int:
        """Linear (C order) index of the chunk at ``coords``."""
        i = 0
        for c, g in zip(coords, self.grid):
            i = i * g + c
        return i

    def box(self, coords: tuple[int, ...]) -> Box:
        """(offset, shape) of the chunk at ``coords``, edge chunks trimmed."""
        off = tuple(c * k for c, k in zip(coords, self.chunk_shape))
        return off, tuple(min(k, s - o) for k, s, o in zip(self.chunk_shape, self.shape, off))

    def region(self, index: int) -> tuple[slice, ...]:
        """The global region chunk ``index`` covers (edge chunks trimmed)."""
        off, shp = self.box(self.coords(index))
        return tuple(slice(o, o + n) for o, n in zip(off, shp))

    def valid_numel(self, index: int) -> int:
        """Elements of chunk ``index`` inside the tensor (padding excluded)."""
        return math.prod(self.box(self.coords(index))[1])

    def overlapping(self, off: tuple[int, ...], shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        """Coordinates of every chunk overlapping the box ``off``/``shape``."""
        if math.prod(shape) == 0 or self.nchunks == 0:
            return iter(())
        return itertools.product(*[range(o // c, -(-(o + n) // c))
                                   for o, n, c in zip(off, shape, self.chunk_shape)])

    def copy_slices(self, coords: tuple[int, ...], off: tuple[int, ...],
                    shape: tuple[int, ...]) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
        """(inside the chunk, inside the box) slices of where chunk ``coords``
        and the box ``off``/``shape`` overlap."""
        src, dst = [], []
        for c, k, o, n, s in zip(coords, self.chunk_shape, off, shape, self.shape):
            lo = max(c * k, o)
            hi = min((c + 1) * k, o + n, s)
            src.append(slice(lo - c * k, hi - c * k))
            dst.append(slice(lo - o, hi - o))
        return tuple(src), tuple(dst)


# ----------------------------------------------------------------------------- a logical tensor's layout


@dataclass
class LogicalTensor:
    """How one logical tensor is laid out in the store: the fields a
    planned tensor (:class:`TensorLayout`) and a committed one
    (:class:`~dstt.format.entries.TensorEntry`) share, and what follows
    from them. Not changed once built (the derived values are cached)."""

    name: str
    kind: str  # "tensor" | "ndarray"
    dtype: DtypeInfo
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    codec: CodecSpec

    # Cached: asked several times per chunk (tens of thousands of tensors:
    # issue 16). Parsers put a grid shared by the tensors of one shape in
    # first (:meth:`share_grid`).
    @cached
    def chunk_grid(self) -> ChunkGrid:
        return ChunkGrid(self.shape, self.chunk_shape)

    @cached
    def grid(self) -> tuple[int, ...]:
        return self.chunk_grid.grid

    @cached
    def nchunks(self) -> int:
        return self.chunk_grid.nchunks

    def share_grid(self, grid: ChunkGrid) -> None:
        """Use ``grid`` (one of this tensor's shape and chunk shape, shared
        by many tensors) as this tensor's chunk grid."""
        self.__dict__["chunk_grid"] = grid

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's values."""
        return math.prod(self.shape) * self.dtype.itemsize

    def coords(self, index: int) -> tuple[int, ...]:
        """Grid coordinates of chunk ``index``."""
        return self.chunk_grid.coords(index)


# ----------------------------------------------------------------------------- regions (shards)


@dataclass
class Region:
    """A box of the logical tensor and the ranks that hold it."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    holders: list[int] = field(default_factory=list)

    @property
    def box(self) -> Box:
        return (self.offset, self.shape)


def check_tiling(shape: tuple[int, ...], regions: list[Region], name: str) -> None:
    """Regions must cover the global box exactly once: no gap, no overlap.

    >>> check_tiling((4,), [Region((0,), (2,)), Region((1,), (3,))], "w")
    Traceback (most recent call last):
    dstt.errors.ShardingError: w: shards at (0,) and (1,) overlap
    """
    total = math.prod(shape)
    vol = 0
    for r in regions:
        if len(r.offset) != len(shape):
            raise ShardingError(f"{name}: shard offset {r.offset} has the wrong rank for shape {shape}")
        for o, n, s in zip(r.offset, r.shape, shape):
            if o < 0 or n < 0 or o + n > s:
                raise ShardingError(f"{name}: shard {r.offset}+{r.shape} lies outside {shape}")
        vol += math.prod(r.shape)
    nonempty = [r for r in regions if math.prod(r.shape) > 0]
    for a, b in itertools.combinations(nonempty, 2):
        if all(ao < bo + bn and bo < ao + an for ao, an, bo, bn in zip(a.offset, a.shape, b.offset, b.shape)):
            raise ShardingError(f"{name}: shards at {a.offset} and {b.offset} overlap")
    if vol != total:
        raise ShardingError(
            f"{name}: shards cover {vol} of {total} elements of shape {shape}; gaps are not allowed"
        )


def interior_boundaries(shape: tuple[int, ...], regions: list[Region]) -> list[set[int]]:
    """Per dimension, the region edges strictly inside the tensor."""
    out: list[set[int]] = [set() for _ in shape]
    for r in regions:
        if math.prod(r.shape) == 0:
            continue
        for d, (o, n) in enumerate(zip(r.offset, r.shape)):
            for b in (o, o + n):
                if 0 < b < shape[d]:
                    out[d].add(b)
    return out


def choose_chunk_shape(
    shape: tuple[int, ...], itemsize: int, boundaries: list[set[int]], max_chunk_bytes: int
) -> tuple[int, ...]:
    """Largest chunks ≤ max_chunk_bytes whose edges fall on every shard boundary.

    >>> choose_chunk_shape((10, 4), 4, [{4, 6}, set()], 1 << 20)
    (2, 4)
    >>> choose_chunk_shape((10, 4), 4, [{4, 6}, set()], 16)  # at most 16 bytes: 4 floats
    (1, 4)
    """
    chunk = []
    constrained = []
    for s, b in zip(shape, boundaries):
        if b:
            chunk.append(math.gcd(*b))
            constrained.append(True)
        else:
            chunk.append(max(s, 1))
            constrained.append(False)
    for d in range(len(chunk)):
        rest = math.prod(chunk[d + 1 :]) * itemsize
        if chunk[d] * rest <= max_chunk_bytes:
            break
        limit = max(1, max_chunk_bytes // max(rest, 1))
        if constrained[d]:
            chunk[d] = max(x for x in _divisors(chunk[d]) if x <= limit) if limit < chunk[d] else chunk[d]
        else:
            parts = -(-chunk[d] // limit)
            chunk[d] = -(-chunk[d] // parts)
    return tuple(chunk)


def _divisors(n: int) -> list[int]:
    small = [i for i in range(1, int(math.isqrt(n)) + 1) if n % i == 0]
    return small + [n // i for i in small]


# ----------------------------------------------------------------------------- a planned tensor


@dataclass
class TensorLayout(LogicalTensor):
    """The global, rank-independent layout of one logical tensor in one step."""

    regions: list[Region]
    #: Chunks of at most this many raw bytes are packed (packs.py); 0: none.
    pack_chunk_bytes: int = field(default_factory=knobs.pack_chunk_bytes)

    @cached
    def array(self) -> str:
        return array_path(self.name, self.sig)

    @cached
    def sig(self) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        chunk = "x".join(map(str, self.chunk_shape)) or "scalar"
        return f"{self.dtype.logical}_{shape}_c{chunk}_{self.codec.tag}"

    @cached
    def packed(self) -> bool:
        """Chunks are appended to the step's packs, not chunk files (docs/format.md "Packs")."""
        return self.nchunks > 0 and self.chunk_nbytes <= self.pack_chunk_bytes

    @cached
    def delta(self) -> bool:
        """Chunks may be stored as differences to a keyframe (docs/format.md
        "Delta chunks"); never packed ones (small: a delta would save little)."""
        return self.codec.delta and self.dtype.itemsize in DELTA_ITEMSIZES and not self.packed

    @property
    def delta_array(self) -> str:
        return self.array + DELTA_SUFFIX

    @property
    def chunk_nbytes(self) -> int:
        return self.chunk_grid.chunk_numel * self.dtype.itemsize

    def linear(self, coords: tuple[int, ...]) -> int:
        return self.chunk_grid.index(coords)

    def chunk_box(self, coords: tuple[int, ...]) -> Box:
        return self.chunk_grid.box(coords)

    def valid_bytes(self, index: int) -> int:
        """Bytes of chunk ``index`` inside the tensor (edge padding excluded)."""
        return self.chunk_grid.valid_numel(index) * self.dtype.itemsize

    def owner(self, region: Region, index: int) -> int:
        """The rank among ``region``'s holders that writes chunk ``index`` (a
        deterministic hash: replicated tensors share the work)."""
        h = zlib.crc32(self.name.encode()) + index
        return region.holders[h % len(region.holders)]

    @cached
    def meta_owner_rank(self) -> int:
        return self.meta_owner()

    def meta_owner(self) -> int:
        """The rank that writes this array's zarr.json (the owner of chunk 0)."""
        if len(self.regions) == 1 and len(self.regions[0].holders) == 1:
            return self.regions[0].holders[0]  # (owner() of a single holder)
        region = next((r for r in self.regions if math.prod(r.shape) > 0), self.regions[0])
        first = tuple(o // c for o, c in zip(region.offset, self.chunk_shape))
        return self.owner(region, self.linear(first) if self.nchunks else 0)


def build_layout(
    name: str, desc: tuple[Any, ...], codec: CodecSpec, max_chunk_bytes: int,
    pack_chunk_bytes: int | None = None,
) -> TensorLayout:
    """The layout of tensor ``name`` from its global description ``(kind,
    dtype name, shape, mode, [(offset, shape, holders), ...])`` (ShardingError
    if its regions do not tile it; InvalidNameError, before anything is
    written, if no store could hold its array path)."""
    kind, dtype, shape, _mode, regions_raw = desc
    info = info_for_name(dtype)
    shape = tuple(shape)
    if len(regions_raw) == 1 and not any(regions_raw[0][0]) and tuple(regions_raw[0][1]) == shape:
        # One region covering the whole tensor (a single process's tensor, a
        # replicated one): it tiles the tensor, and has no interior boundary.
        o, _, h = regions_raw[0]
        regions = [Region(tuple(o), shape, sorted(h))]
        bounds: list[set[int]] = [set()] * len(shape)
    else:
        regions = [Region(tuple(o), tuple(s), sorted(h)) for o, s, h in regions_raw]
        check_tiling(shape, regions, name)
        bounds = interior_boundaries(shape, regions)
    chunk = choose_chunk_shape(shape, info.itemsize, bounds, max_chunk_bytes)
    packing = knobs.pack_chunk_bytes() if pack_chunk_bytes is None else pack_chunk_bytes
    layout = TensorLayout(name, kind, info, shape, chunk, codec, regions, packing)
    layout.__dict__["array"] = array_path(name, layout.sig)  # InvalidNameError now, before anything is written
    if layout.delta:
        array_path(name, layout.sig + DELTA_SUFFIX)
    return layout
