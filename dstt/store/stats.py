"""Per-tensor statistics computed at capture time, chunk by chunk.

Each chunk yields mergeable partials (count, mean, M2, sum of squares, min,
max, non-finite count, and the sum of squares of the update since the
previous captured step); partials from chunks written by different threads or
ranks are merged with Chan's parallel update, so the step index has exact
whole-tensor stats without a second pass over the data (the arithmetic of
partials is torch-free: :mod:`dstt.format.partials`).

Stats columns of ``stats.npy`` (float64, one row per tensor, index order):
``numel, nonfinite, norm, mean, std, min, max, update_norm, update_ratio``.
``std`` uses Bessel's correction like ``torch.Tensor.std()``; NaN/Inf values
propagate (the ``nonfinite`` column counts them). ``update_norm`` is
‖x − prev‖ (prev: the same tensor at the previous captured step, when the
capture has it at hand), ``update_ratio`` is update_norm / norm; both NaN
when prev is unknown.

>>> import torch
>>> a, b = torch.tensor([3.0, 4.0, 0.0]), torch.tensor([3.0, 4.0, 1.0])
>>> row = finalize(merge([chunk_partial(b[:2], a[:2]), chunk_partial(b[2:], a[2:])]))
>>> dict(zip(STATS_COLUMNS, row))["update_norm"], round(dict(zip(STATS_COLUMNS, row))["update_ratio"], 4)
(1.0, 0.1961)
>>> update_sumsq(b.to(torch.float8_e4m3fn), a.to(torch.float8_e4m3fn))  # every dtype (float8 too)
1.0
"""

from __future__ import annotations

import itertools
import math
import threading

import numpy as np
import torch

# The columns these stats fill, and the torch-free arithmetic of partials
# (dstt.format.partials): this module computes partials from tensors.
from dstt.format.layout import STATS_COLUMNS  # noqa: F401 - re-exported
from dstt.format.partials import NAN, Partial, finalize, merge  # noqa: F401 - finalize: re-exported


def _as_float(x: torch.Tensor) -> torch.Tensor:
    if x.dtype in (torch.float32, torch.float64):
        return x
    if x.is_floating_point():
        return x.float()
    if x.is_complex():
        return x.abs().double()
    return x.double()


#: Values per block of the update sum (and of the stats of values that are
#: widened first): the difference is formed block by block in one small
#: scratch buffer (1-2 MiB, cache-resident) instead of materializing
#: whole-chunk temporaries (a fresh 64-256 MiB allocation costs more in page
#: faults than the arithmetic).
UPDATE_BLOCK = 1 << 18


def update_sumsq(x: torch.Tensor, prev: torch.Tensor | None) -> float:
    """Σ (x − prev)² over the values, as float64-safe as ``sumsq``: the
    difference is taken in float32 for matching float32/16/bfloat16/float8
    values (exact: both widen losslessly), in float64 otherwise (float64,
    integers, mixed dtypes), complex128 for complex values; never in a
    low-precision dtype. NaN when ``prev`` is None or its size differs."""
    if prev is None or prev.numel() != x.numel():
        return NAN
    n = x.numel()
    if n == 0:
        return 0.0
    a, b = x.detach().reshape(-1), prev.detach().reshape(-1).to(x.device)
    # (torch refuses to subtract booleans: as 0/1 integers, widened below)
    a, b = (a.to(torch.uint8) if a.dtype == torch.bool else a), (b.to(torch.uint8) if b.dtype == torch.bool else b)
    if a.is_complex() or b.is_complex():
        wide = torch.complex128
    elif a.dtype == b.dtype and a.is_floating_point() and a.element_size() <= 4:
        wide = torch.float32
    else:
        wide = torch.float64
    if n <= UPDATE_BLOCK and a.dtype == b.dtype == wide:
        norm = float(torch.linalg.vector_norm(a - b))
        return norm * norm  # inf on overflow
    scratch = torch.empty(min(n, UPDATE_BLOCK), dtype=wide, device=a.device)
    total = 0.0
    for start in range(0, n, UPDATE_BLOCK):
        block = scratch[: min(UPDATE_BLOCK, n - start)]
        if a.dtype == b.dtype == wide:
            torch.sub(a[start:start + len(block)], b[start:start + len(block)], out=block)
        else:  # widen first: the difference of two low-precision values is exact only in the wider dtype
            block.copy_(a[start:start + len(block)])
            part = b[start:start + len(block)]
            # (torch promotes no float8 dtype with another: widened explicitly)
            block.sub_(part if part.dtype == wide else part.to(wide))
        norm = float(torch.linalg.vector_norm(block))
        total += norm * norm
    return total


def chunk_partial(x: torch.Tensor, prev: torch.Tensor | None = None) -> Partial:
    """Partials of one chunk's logical values (any dtype, any device);
    ``prev`` is the same chunk at the previous captured step (same number of
    values), for the update norm (``usq`` NaN without it).

    Fast path: mean from a sum and M2 from the sum of squares (both cascade
    reductions, ~3-5 GB/s) -- Welford's ``var_mean`` runs at ~0.25 GB/s here.
    ``sumsq - n·mean²`` cancels when |mean| ≫ std (e.g. LayerNorm weights
    near 1), so below a variance/mean² ratio of 1e-2 the exact two-pass
    ``torch.var`` is used instead.
    """
    usq = update_sumsq(x, prev)
    flat = x.detach().reshape(-1)
    if flat.dtype in (torch.float32, torch.float64) or flat.numel() <= UPDATE_BLOCK:
        out = _partial(flat)
    else:
        # Values that must be widened first (bfloat16, float16, float8,
        # integers, complex): block by block, merged exactly (Chan), instead
        # of one whole-chunk float copy whose page faults cost more than the
        # arithmetic (64 MiB of bfloat16: 79 -> ~25 ms).
        out = merge([_partial(flat[i:i + UPDATE_BLOCK]) for i in range(0, flat.numel(), UPDATE_BLOCK)])
    out.usq = usq
    return out


def _partial(flat: torch.Tensor) -> Partial:
    """Partials of 1-d values (widened here if needed); ``usq`` left NaN."""
    n = flat.numel()
    if n == 0:
        return Partial()
    xf = _as_float(flat)
    total = float(xf.sum(dtype=torch.float64) if xf.dtype == torch.float64 else xf.sum())
    mean = total / n
    norm = float(torch.linalg.vector_norm(xf))
    sumsq = norm * norm  # inf on overflow (float ** raises instead)
    lo, hi = torch.aminmax(xf)
    m2 = sumsq - n * mean * mean
    if not (math.isfinite(mean) and math.isfinite(sumsq)):
        nonfinite = int(xf.numel() - torch.isfinite(xf).sum())
        return Partial(n, mean, float("nan"), sumsq, float(lo), float(hi), nonfinite)
    if m2 < 1e-2 * n * mean * mean or m2 <= 0:
        m2 = float(torch.var(xf, correction=0)) * n if n > 1 else 0.0
    return Partial(n, mean, m2, sumsq, float(lo), float(hi), 0)


#: Dtypes :func:`batch_partials` takes: their values widen to float64 as
#: ``chunk_partial`` widens them (complex and float8 values go chunk by chunk).
BATCH_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
                          torch.int32, torch.int64, torch.uint8, torch.bool})
#: Values :func:`batch_partials` widens at once (512 KiB of float64: cache-resident).
BATCH_BLOCK = 1 << 16


def batch_partials(flat: torch.Tensor, counts: list[int],
                   prev: list[torch.Tensor | None] | None = None) -> list[list[float]]:
    """``chunk_partial(x, p).to_list()`` of many small chunks at once.

    ``flat``: the chunks' values back to back (1-d, CPU, a dtype of
    :data:`BATCH_DTYPES`), ``counts[i]`` values each (all > 0); ``prev[i]``:
    chunk i at the previous captured step, or None. Per-segment sums, sums of
    squares, minima and maxima in float64 (``np.*.reduceat``: a few array
    passes for the whole batch instead of ~6 torch calls per chunk); M2 as
    :func:`chunk_partial` computes it, the exact two-pass formula wherever
    ``sumsq - n * mean**2`` would cancel (:func:`_block_m2`). A chunk
    with a non-finite sum or sum of squares (NaN/inf values, overflow) is
    done by :func:`chunk_partial` itself, as are update sums whose previous
    values do not batch (another dtype's widening, a size mismatch).

    >>> import torch
    >>> x = torch.tensor([1.0, 2.0, 3.0, 10.0])
    >>> [r[:6] for r in batch_partials(x, [3, 1])]
    [[3, 2.0, 2.0, 14.0, 1.0, 3.0], [1, 10.0, 0.0, 100.0, 10.0, 10.0]]
    """
    flat = flat.detach()
    k = len(counts)
    n = np.asarray(counts, dtype=np.int64)
    ends = np.cumsum(n)
    starts = ends - n
    total, sumsq, lo, hi, m2 = (np.empty(k) for _ in range(5))
    usq = np.full(k, NAN)
    pflat: torch.Tensor | None = None
    slow: list[int] = []  # update sums done chunk by chunk
    if prev is not None:
        have = [i for i, p in enumerate(prev) if p is not None]
        if len(have) == k and all(p is not None and p.numel() == c and p.device.type == "cpu" and p.dtype == flat.dtype
                                  for p, c in zip(prev, counts)):
            pflat = torch.cat([p.detach().reshape(-1) for p in prev if p is not None])
        else:
            slow = have
    # Block by block (whole segments, ~BATCH_BLOCK values) in two reused
    # float64 scratch buffers: whole-batch float64 temporaries cost more in
    # page faults than the arithmetic.
    size = min(int(ends[-1]), BATCH_BLOCK)
    scratch = _scratch()
    with np.errstate(all="ignore"):  # NaN/inf values: those chunks are redone below
        i = 0
        while i < k:
            a = int(starts[i])
            j = max(i + 1, int(np.searchsorted(ends, a + BATCH_BLOCK, side="right")))
            b = int(ends[j - 1])
            big = b - a > size
            vt = torch.empty(b - a, dtype=torch.float64) if big else scratch[0][:b - a]
            wt = torch.empty(b - a, dtype=torch.float64) if big else scratch[1][:b - a]
            vt.copy_(flat[a:b])
            v, w = vt.numpy(), wt.numpy()
            at = starts[i:j] - a
            total[i:j] = np.add.reduceat(v, at)
            lo[i:j] = np.minimum.reduceat(v, at)
            hi[i:j] = np.maximum.reduceat(v, at)
            np.multiply(v, v, out=w)
            sumsq[i:j] = np.add.reduceat(w, at)
            m2[i:j] = _block_m2(v, w, at, n[i:j], total[i:j], sumsq[i:j])
            if pflat is not None:
                wt.copy_(pflat[a:b])
                np.subtract(v, w, out=w)
                np.multiply(w, w, out=w)
                usq[i:j] = np.add.reduceat(w, at)
            i = j
        mean = total / n
    rows: list[list[float]] = list(map(list, zip(counts, mean.tolist(), m2.tolist(), sumsq.tolist(), lo.tolist(),
                                                  hi.tolist(), itertools.repeat(0, k), usq.tolist())))
    bad = set(np.flatnonzero(~(np.isfinite(total) & np.isfinite(sumsq))).tolist())
    for i in sorted(bad | set(slow)):
        a = int(starts[i])
        seg = flat[a:a + counts[i]]
        p = None if prev is None else prev[i]
        if i in bad:
            rows[i] = chunk_partial(seg, p).to_list()
        else:
            rows[i][7] = update_sumsq(seg, p)
    return rows


#: Segments of a block whose M2 is redone one by one (two-pass) before the
#: whole block is (a few per block: a LayerNorm weight beside other tensors).
TWO_PASS_SEGMENTS = 4


def _block_m2(v: np.ndarray, w: np.ndarray, at: np.ndarray, n: np.ndarray, total: np.ndarray,
              sumsq: np.ndarray) -> np.ndarray:
    """M2 (sum of squared deviations) of the segments of one block: ``v``
    its float64 values, ``w`` scratch of the same size, ``at`` segment
    starts, ``n`` their sizes and ``total``/``sumsq`` their sums. As
    :func:`chunk_partial`: ``sumsq - total * mean`` where that is safe, the
    exact two-pass formula where it would cancel (``M2 < 1e-2 * n * mean**2``,
    ``|mean| >> std``) -- one segment at a time for a few, the whole block in
    two passes for more. A one-value segment's M2 is 0."""
    mean = total / n
    m2: np.ndarray = sumsq - total * mean
    cancels = ((m2 < 1e-2 * n * mean * mean) | (m2 <= 0)) & (n > 1)
    m2[n == 1] = 0.0
    redo = np.flatnonzero(cancels)
    if len(redo) > TWO_PASS_SEGMENTS:
        np.subtract(v, np.repeat(mean, n), out=w)
        np.multiply(w, w, out=w)
        whole: np.ndarray = np.add.reduceat(w, at)
        return whole
    for q in redo.tolist():
        a = int(at[q])
        d = v[a:a + int(n[q])] - mean[q]
        m2[q] = float(np.dot(d, d))
    return m2


_SCRATCH = threading.local()


def _scratch() -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's two float64 scratch buffers of BATCH_BLOCK values, kept
    from call to call: new ones each call cost their page faults again (a
    capture helper calls this for every step; issue 16). Only the calling
    thread uses them, only during one call."""
    bufs: tuple[torch.Tensor, torch.Tensor] | None = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = (torch.empty(BATCH_BLOCK, dtype=torch.float64),
                                torch.empty(BATCH_BLOCK, dtype=torch.float64))
    return bufs
