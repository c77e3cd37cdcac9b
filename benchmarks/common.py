"""Shared helpers for the benchmarks: machine description, timing, state."""

from __future__ import annotations

import os
import platform
import resource
import shutil
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, Python {platform.python_version()}, "
            f"torch {torch.__version__}")


@contextmanager
def timer(out: dict, key: str) -> Iterator[None]:
    t = time.perf_counter()
    yield
    out[key] = time.perf_counter() - t


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def fresh_dir(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, exist_ok=True)
    return path


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def model_and_adam(total_bytes: int, n_params: int = 100, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of ``n_params`` fp32 matrices with Adam state: parameters plus
    exp_avg and exp_avg_sq make ~``total_bytes`` in ~3·n_params tensors."""
    torch.manual_seed(seed)
    per_param = total_bytes // 3 // n_params // 4
    cols = 1024
    rows = max(1, per_param // cols)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(rows, cols)) for _ in range(n_params)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def raw_fsync_write(path: str, tensors: list[torch.Tensor]) -> None:
    """The physical reference: the same bytes written sequentially, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            os.write(fd, memoryview(t.detach().contiguous().numpy()).cast("B"))
        os.fsync(fd)
    finally:
        os.close(fd)


def best_of(fn: Callable[[], object], times: int = 3) -> float:
    """The fastest of ``times`` timed calls of ``fn``, in seconds."""
    best = float("inf")
    for _ in range(times):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def raw_copy_s(tensors: list[torch.Tensor]) -> float:
    """One copy_ of every tensor into a buffer allocated and faulted in
    beforehand (pinned, for CUDA sources, synchronized) (median of 3)."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    cuda = tensors[0].is_cuda
    host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=cuda)
    times = []
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        off = 0
        for x in tensors:
            n = x.numel() * x.element_size()
            host[off:off + n].view(x.dtype).view(x.shape).copy_(x, non_blocking=cuda)
            off += n
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[1]


def timed(out: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` wrapped: each call's wall time appended to ``out`` (the
    optimizer hook's wait, timed as part of a stall)."""
    def wrapper(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            out.append(time.perf_counter() - t)

    return wrapper
