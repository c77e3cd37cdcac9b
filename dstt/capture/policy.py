"""Capture's decisions as pure functions: pool sizing and the skip policy.

Nothing here touches threads, tensors or the store, so each rule is tested
by itself (tests/capture/test_capture_policy.py) and the engine only applies them.

>>> pool_bytes(need_bytes=30 << 20, biggest_bytes=1 << 20, limit_bytes=None)
62914560
>>> skip_reason(capacity_bytes=100, outstanding_bytes=60, need_bytes=50) is not None
True
"""

from __future__ import annotations

from dataclasses import dataclass

_MIB = 1 << 20


def is_due(step: int, every: int) -> bool:
    """Whether ``snapshot(step)`` captures at all under ``every``.

    >>> [s for s in range(7) if is_due(s, 3)]
    [0, 3, 6]
    """
    return step % every == 0


#: A pool for small steps holds up to this many steps, within SMALL_POOL_BYTES
#: (8 left a 1.2 MB, 12 ms loop waiting for pool space during the helper's
#: group syncs: docs/benchmarks.md, issue 16 session 4).
SMALL_STEPS = 16
SMALL_POOL_BYTES = 32 << 20


def pool_bytes(*, need_bytes: int, biggest_bytes: int, limit_bytes: int | None) -> int:
    """Capacity of a new staging pool for steps of ``need_bytes``.

    Two steps (step k+1 is staged while step k is written and committed),
    and for small steps up to SMALL_STEPS of them within SMALL_POOL_BYTES (a
    fast loop's steps queue up while one is committed, and are then
    committed as a group: capture/committers.py), at least the largest
    chunk and 1 MiB, rounded up to a MiB, and never above an explicit
    ``limit_bytes`` (a hard bound set by the user).

    >>> pool_bytes(need_bytes=10, biggest_bytes=10, limit_bytes=None)
    1048576
    >>> pool_bytes(need_bytes=1 << 20, biggest_bytes=1 << 10, limit_bytes=None) >> 20
    16
    >>> pool_bytes(need_bytes=100 << 20, biggest_bytes=1 << 20, limit_bytes=64 << 20)
    67108864
    """
    want = max(2 * need_bytes, min(SMALL_STEPS * need_bytes, SMALL_POOL_BYTES), biggest_bytes, _MIB)
    want = -(-want // _MIB) * _MIB
    return want if limit_bytes is None else min(want, limit_bytes)


def should_grow(*, need_bytes: int, capacity_bytes: int, limit_bytes: int | None) -> bool:
    """Whether an existing pool should be replaced (once idle) by a larger
    one: a step no longer fits it and the limit allows more.

    >>> should_grow(need_bytes=5, capacity_bytes=4, limit_bytes=None)
    True
    >>> should_grow(need_bytes=5, capacity_bytes=4, limit_bytes=4)
    False
    """
    return need_bytes > capacity_bytes and (limit_bytes is None or capacity_bytes < limit_bytes)


def step_need_bytes(block_bytes: list[int]) -> int:
    """Pool bytes a step's blocks may take: their sum plus the largest
    block (a block cannot straddle the ring's wrap, so up to that much may
    go unused at the end of the ring).

    >>> step_need_bytes([64, 128])
    320
    >>> step_need_bytes([])
    0
    """
    return sum(block_bytes) + max(block_bytes, default=0)


def skip_reason(*, capacity_bytes: int, outstanding_bytes: int, need_bytes: int) -> str | None:
    """Why a step cannot be staged now without waiting (``on_full="skip"``),
    or None. Never skip when nothing is in flight: waiting could not help,
    and a step larger than the pool is staged in parts.

    >>> skip_reason(capacity_bytes=100, outstanding_bytes=0, need_bytes=500) is None
    True
    >>> skip_reason(capacity_bytes=100, outstanding_bytes=40, need_bytes=60) is None
    True
    >>> skip_reason(capacity_bytes=100, outstanding_bytes=41, need_bytes=60)
    'staging pool full: 41 of 100 bytes still in flight, 60 needed'
    """
    if outstanding_bytes <= 0 or capacity_bytes - outstanding_bytes >= min(need_bytes, capacity_bytes):
        return None
    return f"staging pool full: {outstanding_bytes} of {capacity_bytes} bytes still in flight, {need_bytes} needed"


@dataclass(frozen=True)
class ShmDecision:
    """Where the staging pool lives: ``"shm"`` (a file under /dev/shm, it
    outlives the trainer) or ``"process"`` (anonymous memory, lost with it),
    and the warning to give when it falls back."""

    where: str
    warning: str | None = None


def shm_decision(*, pool_bytes: int, shm_free_bytes: int | None, reserve_bytes: int = 16 * _MIB) -> ShmDecision:
    """Put the pool in /dev/shm when it fits with ``reserve_bytes`` to
    spare; otherwise fall back to an in-process pool, with a warning naming
    the size needed (a training job must not refuse to start because of
    Docker's 64 MB default, but it must be told what it loses).

    >>> shm_decision(pool_bytes=1 << 30, shm_free_bytes=8 << 30).where
    'shm'
    >>> d = shm_decision(pool_bytes=1 << 30, shm_free_bytes=64 << 20)
    >>> d.where, "1073741824" in d.warning
    ('process', True)
    """
    if shm_free_bytes is None:
        return ShmDecision("process", "no /dev/shm on this system: staged steps do not survive the trainer")
    if pool_bytes + reserve_bytes <= shm_free_bytes:
        return ShmDecision("shm")
    return ShmDecision(
        "process",
        f"/dev/shm has {shm_free_bytes} bytes free, the staging pool needs {pool_bytes} "
        f"(+{reserve_bytes} spare): using an in-process pool, so steps staged but not yet committed "
        "are lost if the trainer dies (raise the size of /dev/shm, e.g. docker --shm-size, "
        "or lower host_buffer_bytes)",
    )
