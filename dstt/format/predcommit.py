"""What the commit phase needs of a step's predictive coding (torch-free):
the coder's decisions for the step (:class:`PredStep`, made by
dstt/store/predflush.py before the flush), the ``pred`` record of each
index entry (:func:`pred_info`) and the chunks coded against a step that
did not commit (:func:`dangling`), which the commit stores whole
(dstt/format/commit.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, TypeVar

from dstt.format.codecs.delta import DELTA_ITEMSIZES
from dstt.format.codecs.keyframes import Decision
from dstt.format.codecs.predictors import Coding
from dstt.format.codecs.stepcoder import groups_of
from dstt.format.predindex import ChunkPred, PredInfo


class ChunkResult(Protocol):
    """What is read of a chunk's result (dstt.format.commit.ChunkResult)."""

    pred: ChunkPred | None
    coding: Coding | None


R = TypeVar("R", bound=ChunkResult)


@dataclass
class PredStep:
    """What the step coder decided for one step (predflush.prepare)."""

    #: (array, chunk index) -> how that chunk is stored.
    decisions: dict[tuple[str, int], Decision] = field(default_factory=dict)
    #: tensor name -> its group's inputs (role -> tensor name), for the index.
    inputs: dict[str, dict[str, str]] = field(default_factory=dict)


def codable(layout: Any) -> bool:
    """Whether a tensor's chunks may be predictively coded: a predictive
    codec (``compression="predictive"`` or ``"auto"``) and an item size of
    1, 2, 4 or 8 bytes (complex128 never is)."""
    return bool(layout.codec.predictive and layout.dtype.itemsize in DELTA_ITEMSIZES
                and not layout.dtype.logical.startswith("complex"))


def step_inputs(tree: Any, layouts: Sequence[Any]) -> PredStep:
    """A step's groups' inputs (no decisions) from its value tree and
    tensor layouts alone, as :func:`dstt.store.predflush.prepare` records
    them: for a commit of chunks coded by other processes (the salvage of
    every rank's records) whose writer did not code the step itself."""
    shapes = {lay.name: (lay.dtype.logical, tuple(lay.shape), tuple(lay.chunk_shape))
              for lay in layouts if codable(lay)}
    return PredStep(inputs={m.name: g.inputs for g in groups_of(tree, shapes) for m in g.members})


def pred_info(pred: PredStep | None, name: str, delta_array: str, chunks: Sequence[ChunkResult]) -> PredInfo | None:
    """The ``pred`` record of tensor ``name``'s index entry from its chunk
    results (``pred``: the step's decisions); None when no chunk is
    predictively coded."""
    if all(c.pred is None for c in chunks):
        return None
    inputs = None if pred is None else pred.inputs.get(name)
    codings: list[Coding] = []
    recs: list[ChunkPred | None] = []
    for c in chunks:
        if c.pred is None or c.coding is None:
            recs.append(None)
            continue
        if c.coding not in codings:
            codings.append(c.coding)
        recs.append(ChunkPred(codings.index(c.coding), c.pred.cur, c.pred.prev))
    if inputs is None:  # (no groups recorded for the step: its own role only)
        inputs = {c.role: name for c in codings}
    return PredInfo(delta_array, dict(inputs), codings, recs)


def dangling(results: Sequence[R], step: int, committed: Callable[[int], bool]) -> list[R]:
    """Results of predictive chunks coded against a step that is not
    committed (``committed(step)`` False): they must be stored whole."""
    return [r for r in results if r.pred is not None
            and any(s != step and not committed(s) for s in (r.pred.cur, r.pred.prev))]


def decision_raw(pred: Any, array: str, index: int) -> Any:
    """The raw bytes the coder kept of chunk ``index`` of ``array`` (None if none)."""
    d = None if pred is None else pred.decisions.get((array, index))
    return None if d is None else d.raw


__all__ = ["PredStep", "codable", "dangling", "decision_raw", "pred_info", "step_inputs"]
