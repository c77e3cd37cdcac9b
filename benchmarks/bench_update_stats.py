"""Issue 14 item 5: what the update statistics (``update_norm``,
``update_ratio``: ‖θₖ − θₖ₋₁‖ and its ratio to ‖θₖ‖) add to the per-chunk
stats the writer computes anyway, and what ``find``'s update-jump check adds
to a search.

    python benchmarks/bench_update_stats.py [--chunk-mib 64] [--reps 5]

Compared in one run, on the same chunk (fp32 and bf16, the previous step's
chunk a small perturbation of it):

* the stats and the update sum as first written (whole-chunk widened copies:
  ``_partial(x)``, ``‖float(x) − float(prev)‖``) vs block by block
  (``chunk_partial(x)``, ``chunk_partial(x, prev)``) vs one ``memcpy`` of the
  chunk into a warm buffer;
* ``find``'s update-ratio baseline per step (median of the previous 8 ratios
  of 1000 tensors): ``np.nanmedian`` vs the sort-based median it uses.

Best of ``--reps``; ratios are what to read.
"""

from __future__ import annotations

import argparse
import platform
import time
import warnings
from typing import Callable

import numpy as np
import torch


def best(fn: Callable[[], object], reps: int) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)


def one_dtype(dtype: torch.dtype, args: argparse.Namespace) -> None:
    """The chunk timings for one dtype (one line)."""
    from dstt.store.stats import _as_float, _partial, chunk_partial

    def whole_update(cur: torch.Tensor, prev: torch.Tensor) -> float:
        """The first version: whole-chunk widened copies and difference."""
        return float(torch.linalg.vector_norm(_as_float(cur) - _as_float(prev))) ** 2

    n = args.chunk_mib * (1 << 20) // torch.empty(0, dtype=dtype).element_size()
    g = torch.Generator().manual_seed(0)
    prev = torch.randn(n, generator=g).to(dtype)
    cur = (prev.float() + 1e-3 * torch.randn(n, generator=g)).to(dtype)
    buf = torch.empty_like(cur)
    t_copy = best(lambda: buf.copy_(cur), args.reps)
    t_old_stats = best(lambda: _partial(cur), args.reps)
    t_old_update = best(lambda: whole_update(cur, prev), args.reps)
    t_stats = best(lambda: chunk_partial(cur), args.reps)
    t_both = best(lambda: chunk_partial(cur, prev), args.reps)
    gib = args.chunk_mib / 1024
    print(f"{str(dtype):15s} {args.chunk_mib} MiB chunk: memcpy {t_copy * 1e3:6.1f} ms ({gib / t_copy:4.1f} GiB/s) | "
          f"stats: whole-chunk {t_old_stats * 1e3:6.1f} ms, blocked {t_stats * 1e3:6.1f} ms | "
          f"update: whole-chunk {t_old_update * 1e3:6.1f} ms, blocked {(t_both - t_stats) * 1e3:6.1f} ms | "
          f"stats+update {t_both * 1e3:6.1f} ms = {t_both / t_copy:.1f} memcpys "
          f"(whole-chunk {(t_old_stats + t_old_update) / t_copy:.1f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk-mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from dstt.analysis.anomaly import _nanmedian_rows

    torch.set_num_threads(1)
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread")
    for dtype in (torch.float32, torch.bfloat16):
        one_dtype(dtype, args)
    a = np.random.default_rng(0).random((1000, 8))
    a[:, :3] = np.nan

    def nanmedian() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for _ in range(100):
                np.nanmedian(a, axis=1)

    def sort_median() -> None:
        for _ in range(100):
            _nanmedian_rows(a)

    t_np, t_ours = best(nanmedian, args.reps) / 100, best(sort_median, args.reps) / 100
    print(f"find update-jump baseline, 1000 tensors x 8 ratios per step: np.nanmedian {t_np * 1e6:.0f} us, "
          f"sort-based {t_ours * 1e6:.0f} us ({t_np / t_ours:.1f}x less)")


if __name__ == "__main__":
    main()
