"""Tensors from one rank to every rank as one flat byte buffer (no pickling).

dstt's collectives of small records go through the coordinator's
``all_gather`` (pickled objects). Chunks of a step -- hundreds of megabytes
when a rewind or a restore from rebuilt memory reads what other ranks hold
-- go as one ``uint8`` tensor a sending rank, broadcast over dstt's own gloo
group: every rank learns the sizes first (a small all-gather), the sender
packs its chunks at aligned offsets, the others receive into memory of
that size and view each chunk back as its dtype and shape.

>>> from dstt.store.coord import LocalCoordinator
>>> a, b = torch.arange(3, dtype=torch.int16), torch.ones(2, 2)
>>> flat, starts = cast(LocalCoordinator(), 0, [nbytes(a), nbytes(b)], [a, b])
>>> starts, view_of(flat, starts[1], torch.float32, (2, 2)).sum().item()
([0, 64, 128], 4.0)
"""

from __future__ import annotations

from typing import Any

import torch

#: Each chunk starts at a multiple of this many bytes (a view as any dtype needs it).
ALIGN_BYTES = 64


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def aligned_starts(sizes: list[int], align: int = ALIGN_BYTES) -> list[int]:
    """Where each of ``sizes`` bytes starts in one flat buffer, each start a
    multiple of ``align``; the buffer's size last.

    >>> aligned_starts([3, 64, 1]), aligned_starts([])
    ([0, 64, 128, 192], [0])
    """
    starts, at = [], 0
    for n in sizes:
        starts.append(at)
        at += -(-n // align) * align
    return [*starts, at]


def cast(coord: Any, src: int, sizes: list[int], tensors: list[torch.Tensor] | None) -> tuple[torch.Tensor, list[int]]:
    """Collective (every rank, the same ``src`` and ``sizes``): rank
    ``src``'s ``tensors`` (``sizes`` bytes each; None elsewhere) packed into
    one flat buffer on ``src`` and broadcast to every rank; (the buffer,
    the chunks' starts and its size)."""
    starts = aligned_starts(sizes)
    flat = torch.empty(starts[-1], dtype=torch.uint8)
    if coord.rank == src:
        if tensors is None or len(tensors) != len(sizes):
            raise ValueError("the sending rank gives one tensor for each size")
        for t, at, n in zip(tensors, starts, sizes):
            if n:
                flat[at:at + n].copy_(t.detach().reshape(-1).view(torch.uint8))
    if starts[-1]:
        coord.broadcast_tensor(flat, src)
    return flat, starts


def view_of(flat: torch.Tensor, start: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The chunk of ``dtype`` and ``shape`` at byte ``start`` of ``flat`` (a view)."""
    n = (torch.empty((), dtype=dtype).element_size() * int(torch.Size(shape).numel()))
    return flat[start:start + n].view(dtype).reshape(shape)


__all__ = ["ALIGN_BYTES", "aligned_starts", "cast", "nbytes", "view_of"]
