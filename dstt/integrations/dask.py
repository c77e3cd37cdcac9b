"""A store as Dask and xarray arrays: ``dstt.to_dask`` and ``dstt.to_xarray``
(``pip install 'dstt[dask]'``).

``to_dask(store, name)`` is a lazy ``dask.array`` of one tensor over steps:
a leading step axis, then the tensor's own axes chunked exactly as dstt
chunked them, so a block is one stored chunk of one step (or of
``steps_per_chunk`` steps). Each block is read inside its task by the same
checked reads as every other dstt read: delta-coded, predictive-coded and
packed chunks are decoded there, which plain ``dask.array.from_zarr``
cannot do. The array carries only the store's URL, ``storage_options`` and
the steps to read, never an open handle, so it runs on a
``dask.distributed`` cluster whose workers open the store themselves
(object stores with the given ``storage_options``; a local path must be
the same path on the workers).

bfloat16 and float8 tensors (which numpy has not) come as float32, exactly
(``bits=True``: their raw bits as unsigned integers instead).

``to_xarray`` wraps the same arrays with coordinates -- ``step``, and along
it ``time`` (the commit time, seconds since the epoch) and ``branch`` (the
branch of the lineage each step belongs to) -- so that
``da.sel(step=slice(1000, 2000)).std("step")`` works as a Pangeo user
expects. One name gives a ``DataArray``, globs or several names a
``Dataset``.

>>> import tempfile, torch, dstt
>>> path = tempfile.mkdtemp() + "/run"
>>> for s in range(3):
...     _ = dstt.save(path, s, {"w": torch.full((2, 3), float(s))})
>>> x = dstt.to_dask(path, "w")
>>> x.shape, float(x.sum().compute(scheduler="sync"))
((3, 2, 3), 18.0)
>>> float(dstt.to_xarray(path, "w").sel(step=slice(1, 2)).mean().compute(scheduler="sync"))
1.5
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dstt.analysis.select import lineage_points
from dstt.errors import ConfigError, CorruptStoreError, TensorNotFoundError
from dstt.format.scan import StoreSpec, opened

if TYPE_CHECKING:
    from dstt.format.index import RunIndex


def _require() -> Any:
    try:
        import dask.array as da
    except ImportError:
        raise ConfigError("dstt.to_dask needs dask: pip install 'dstt[dask]'") from None
    return da


def _open(store: Any, storage_options: dict[str, Any] | None) -> "RunIndex":
    from dstt.format.index import RunIndex

    if isinstance(store, RunIndex):
        return store
    return RunIndex(store, storage_options=storage_options)


@dataclass
class StepStack:
    """One tensor over steps as an array-like for ``dask.array.from_array``:
    ``stack[steps, ...]`` reads the chunks of those steps overlapping the
    selection (in the process that indexes it: a worker opens the store)."""

    spec: StoreSpec | None
    local: Any  # the open reader when the store cannot be reopened elsewhere (memory://)
    name: str
    points: list[tuple[str, int]]
    tensor_shape: tuple[int, ...]
    logical: str
    storage: str
    bits: bool

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.points), *self.tensor_shape)

    @property
    def ndim(self) -> int:
        return 1 + len(self.tensor_shape)

    @property
    def dtype(self) -> np.dtype:
        if self.storage != self.logical and not self.bits:
            return np.dtype("float32")
        return np.dtype(self.storage)

    def _reader(self) -> Any:
        if self.spec is None:
            return self.local
        from dstt.format.index import RunIndex

        return opened(self.spec, RunIndex)

    def __getitem__(self, key: Any) -> np.ndarray:
        key = key if isinstance(key, tuple) else (key,)
        key = key + (slice(None),) * (self.ndim - len(key))
        steps = range(len(self.points))[key[0]]
        inner = key[1:]
        run = self._reader()
        parts = [self._widen(run.read_array(self.name, s, branch=b, index=inner if inner else None))
                 for b, s in (self.points[i] for i in steps)]
        if isinstance(key[0], (int, np.integer)):
            return parts[0]
        if not parts:
            return np.empty((0, *np.empty(self.tensor_shape)[inner].shape), dtype=self.dtype)
        return np.stack(parts)

    def _widen(self, arr: np.ndarray) -> np.ndarray:
        if self.storage == self.logical or self.bits:
            return arr
        import torch

        from dstt.format.dtypes import info_for_name
        from dstt.store.torch_dtypes import from_storage

        t = from_storage(torch.from_numpy(np.ascontiguousarray(arr)), info_for_name(self.logical))
        return t.to(torch.float32).numpy()


def _stack(run: "RunIndex", name: str, points: list[tuple[str, int]], bits: bool) -> tuple[StepStack, tuple[int, ...]]:
    """The StepStack of ``name`` over ``points`` and its chunk shape; every
    step must hold the tensor with the same shape and dtype."""
    first = None
    for b, s in points:
        rec = run.record(s, branch=b)
        e = rec.by_name.get(name)
        if e is None:
            from dstt.format.index import suggest

            raise TensorNotFoundError(f"no tensor {name!r} at step {s} of branch {b!r}{suggest(name, rec.by_name)}")
        if first is None:
            first = e
        elif e.shape != first.shape or e.dtype != first.dtype:
            raise CorruptStoreError(
                f"{name}: step {s} of branch {b!r} holds {list(e.shape)} {e.dtype.logical}, step {points[0][1]} "
                f"{list(first.shape)} {first.dtype.logical}: choose steps where it has one shape (steps=...)")
    assert first is not None
    spec = StoreSpec.of(run)
    stack = StepStack(spec, run if spec is None else None, name, points, first.shape, first.dtype.logical,
                      first.dtype.storage, bits)
    return stack, first.chunk_shape


def to_dask(store: Any, name: str, steps: Any = None, branch: str | None = None, *,
            storage_options: dict[str, Any] | None = None, steps_per_chunk: int = 1, bits: bool = False) -> Any:
    """Tensor ``name`` of ``store`` (a path, URL, reference or open Run) over
    the steps of ``branch``'s lineage (``steps``: None for all, a list, a
    ``range`` or a ``slice``) as a lazy ``dask.array`` of shape
    ``(steps, *shape)``, chunked ``(steps_per_chunk, *dstt's chunk shape)``."""
    da = _require()
    if not isinstance(steps_per_chunk, int) or steps_per_chunk < 1:
        raise ConfigError(f"steps_per_chunk must be a positive integer, got {steps_per_chunk!r}")
    run = _open(store, storage_options)
    stack, chunk_shape = _stack(run, name, lineage_points(run, steps, branch), bits)
    return _as_dask(da, run, stack, chunk_shape, steps_per_chunk)


def _as_dask(da: Any, run: "RunIndex", stack: StepStack, chunk_shape: tuple[int, ...], steps_per_chunk: int) -> Any:
    from dask.base import tokenize

    chunks = (steps_per_chunk, *(c or 1 for c in chunk_shape))
    token = tokenize(run.url, stack.name, stack.points, stack.bits,
                     [run.record(s, branch=b).by_name[stack.name].checksum for b, s in stack.points])
    return da.from_array(stack, chunks=chunks, name=f"dstt-{stack.name}-{token}", asarray=False, fancy=False,
                         lock=False, meta=np.empty((0,) * stack.ndim, dtype=stack.dtype))


def to_xarray(store: Any, names: Any, steps: Any = None, branch: str | None = None, *,
              storage_options: dict[str, Any] | None = None, steps_per_chunk: int = 1, bits: bool = False) -> Any:
    """``names`` (a name gives a ``DataArray``; globs or a list a
    ``Dataset``) over steps, with ``step``, ``time`` and ``branch``
    coordinates; dims ``("step", "dim_0", ...)`` for one tensor,
    ``("step", "<name>/0", ...)`` in a Dataset."""
    da = _require()
    try:
        import xarray as xr
    except ImportError:
        raise ConfigError("dstt.to_xarray needs xarray: pip install 'dstt[dask]'") from None
    from dstt.analysis.select import is_glob, require_matches

    run = _open(store, storage_options)
    points = lineage_points(run, steps, branch)
    commits = [run.record(s, branch=b).commit for b, s in points]
    coords = {"step": ("step", np.array([s for _, s in points], dtype=np.int64)),
              "time": ("step", np.array([float(c.get("time", np.nan)) for c in commits])),
              "branch": ("step", np.array([b for b, _ in points], dtype=object))}
    single = isinstance(names, str) and not is_glob(names)
    pats = [names] if isinstance(names, str) else list(names)
    last = run.record(points[-1][1], branch=points[-1][0])
    wanted = require_matches(last.names, pats, f"at step {points[-1][1]} of branch {points[-1][0]!r}")
    arrays = {}
    for n in wanted:
        stack, chunk_shape = _stack(run, n, points, bits)
        dims = ("step", *(f"dim_{k}" if single else f"{n}/{k}" for k in range(len(stack.tensor_shape))))
        arrays[n] = xr.DataArray(_as_dask(da, run, stack, chunk_shape, steps_per_chunk), dims=dims, coords=coords,
                                 name=n, attrs={"dstt_store": run.url, "dtype": stack.logical})
    if single:
        return arrays[wanted[0]]
    return xr.Dataset(arrays, coords=coords, attrs={"dstt_store": run.url})


__all__ = ["to_dask", "to_xarray", "StepStack"]
