"""The zarr.json documents of a store's arrays and groups, written by the
first step that uses them (:class:`ArrayDocs`, a part of the Writer): so
that a committed step never points at an array plain zarr-python cannot
open, and Zarr tools that walk the hierarchy list every array."""

from __future__ import annotations

from dstt.errors import CorruptStoreError
from dstt.format import layout as L
from dstt.format.backends import Backend
from dstt.format.codecs.spec import array_metadata, delta_array_metadata, group_metadata
from dstt.format.packs import PACKS
from dstt.store.plan import StepPlan
from dstt.store.predflush import pred_layout


class ArrayDocs:
    """The array and group documents of ``backend`` this writer knows good
    (checked or written once per writer; arrays of the previous step are
    known good, so steady-state steps read no metadata at all)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.known_arrays: set[str] = set()
        self.known_groups: set[str] = set()

    def ensure(self, plan: StepPlan, *, groups: bool) -> None:
        """Write the zarr.json of arrays first used by this step (owner rank only).

        An existing document is kept only if it has exactly the expected
        bytes: a writer killed while writing one (before its step committed)
        leaves it empty or partial, and a committed step must never point at
        an array plain zarr-python cannot open. Arrays of the previous step
        are known good, so steady-state steps read no metadata at all.
        """
        if groups:  # (the owner rank: rank 0)
            self._ensure_groups(plan)
        for layout in plan.meta_arrays:
            if layout.packed:
                continue  # its chunks live in packs: no zarr array (docs/format.md "Packs")
            if layout.array not in self.known_arrays:
                self._ensure_doc(layout.array, array_metadata(
                    layout.dtype, layout.shape, layout.chunk_shape, layout.codec, layout.name))
            # Checked once per writer: gc removes a delta array none of whose
            # chunks a step references, while its keyframe array stays.
            if (layout.delta or pred_layout(layout)) and layout.delta_array not in self.known_arrays:
                self._ensure_doc(layout.delta_array, delta_array_metadata(
                    layout.dtype, layout.shape, layout.chunk_shape, layout.name))

    def _ensure_doc(self, path: str, doc: bytes) -> None:
        key = L.zarr_json_key(path)
        if self._differs(key, doc):
            self.backend.put(key, doc)
        self.known_arrays.add(path)

    def _differs(self, key: str, doc: bytes) -> bool:
        """Whether the document at ``key`` is not exactly ``doc`` -- read
        bounded by ``doc``'s size (a longer file differs, unread)."""
        try:
            return self.backend.get(key, max_bytes=len(doc)) != doc
        except CorruptStoreError as e:
            if "not a regular file" in str(e):
                raise  # a FIFO or device there: refused, not written through
            return True

    def _ensure_groups(self, plan: StepPlan) -> None:
        """Rank 0: a group ``zarr.json`` in every directory between
        ``tensors/`` and an array, so Zarr tools that walk the hierarchy
        (zarr-python, xarray, zarrs) list every array. Written once, like
        array documents; checked once per writer."""
        doc = group_metadata()
        if PACKS not in self.known_groups and any(layout.packed for layout in plan.layouts):
            if self._differs(L.zarr_json_key(PACKS), doc):
                self.backend.put(L.zarr_json_key(PACKS), doc)
            self.known_groups.add(PACKS)
        for layout in plan.layouts:
            if layout.packed:
                continue
            parts = layout.array.split("/")[1:-1]  # below tensors/, above @<sig>
            for depth in range(1, len(parts) + 1):
                group = "/".join([L.TENSORS, *parts[:depth]])
                if group in self.known_groups:
                    continue
                key = L.zarr_json_key(group)
                if self._differs(key, doc):
                    self.backend.put(key, doc)
                self.known_groups.add(group)


__all__ = ["ArrayDocs"]
