"""Device-to-host copies of CUDA sources into the host pool (hostpool.py),
on copy streams of their own, ordered after the compute stream by events."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _cuda_event() -> Any:
    """A new torch.cuda.Event (its constructor is untyped)."""
    make: Callable[[], Any] = torch.cuda.Event
    return make()


class CudaCopier:
    """Device-to-host copies on dedicated streams, ordered after the compute
    stream by events; the trainer's thread never synchronizes the device."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}

    def stream(self, device: torch.device) -> Any:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._streams:
            make_stream: Callable[..., Any] = torch.cuda.Stream  # (its constructor is untyped)
            self._streams[idx] = make_stream(device=idx)
        return self._streams[idx]

    def after_compute(self, devices: set[torch.device]) -> dict[int, Any]:
        """Record an event on each device's current (compute) stream: copies
        issued after waiting on it read the state as of this call."""
        events = {}
        for d in devices:
            ev = _cuda_event()
            ev.record(torch.cuda.current_stream(d))
            events[d.index] = ev
        return events

    def copy(self, dst: torch.Tensor, src: torch.Tensor, ready: Any, mode: str = "pinned") -> None:
        """Enqueue ``dst.copy_(src)`` on the copy stream after ``ready``;
        ``mode`` from :meth:`HostPool.copy_mode` (synchronous unless
        ``"pinned"``)."""
        s = self.stream(src.device)
        s.wait_event(ready)
        with torch.cuda.stream(s):
            if mode == "bounce":
                bounce = torch.empty(dst.shape, dtype=dst.dtype, pin_memory=True)
                bounce.copy_(src, non_blocking=True)
            else:
                dst.copy_(src, non_blocking=mode == "pinned")
        # The caching allocator must not hand src's memory to someone else
        # before this copy ran, even if the trainer drops its last reference.
        src.record_stream(s)
        if mode == "bounce":
            done = _cuda_event()
            done.record(s)
            done.synchronize()  # unbounded wait: device work (a bounce copy on the GPU)
            dst.copy_(bounce)

    def done(self, devices: set[torch.device]) -> dict[int, Any]:
        """An event after every copy enqueued so far on each device."""
        events = {}
        for d in devices:
            ev = _cuda_event()
            ev.record(self.stream(d))
            events[d.index] = ev
        return events


__all__ = ["CudaCopier"]
