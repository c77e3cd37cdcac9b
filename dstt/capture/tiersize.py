"""The memory tier's sizes (issue 14, 25): how many step slots it takes,
how large one is, and the memory the host has available for them. Used by
the tier in the trainer's process (tier.py), its committer (committers.py)
and the capture helper (helper.py): a plan's tasks are read, nothing is
allocated."""

from __future__ import annotations

import math

from dstt.capture.hostpool import ALIGN, PAGE, PAGE_BLOCK_BYTES
from dstt.store.plan import StepPlan

#: Slots beyond K: the step being staged, one being written after it left the
#: ring, the step before that one (read for the update statistics), and the
#: one the NaN/Inf watcher is checking (with the K checked steps before it
#: kept: MemoryTier.evict; a watcher further behind makes the
#: trainer wait for a slot, or check steps itself: _tier_pool).
EXTRA_SLOTS = 4
def round_up(n: int, k: int) -> int:
    """``n`` rounded up to a multiple of ``k``."""
    return -(-n // k) * k


def slot_bytes_for(plan: StepPlan) -> int:
    """Bytes of one slot holding this rank's share of ``plan`` (blocks are
    aligned like HostPool's, plus one page of slack).

    Small tasks are staged in groups (stager.py: ``group_tasks`` and the
    lazy runs, up to ``GROUP_BYTES`` each); a group of ``PAGE_BLOCK_BYTES``
    or more is placed like a large block -- on a page boundary, rounded up
    to a page -- so each may take up to two pages more than its tasks'
    bytes. At most ``small // PAGE_BLOCK_BYTES`` groups are that large,
    whatever the grouping. (Without them a state of 150 tasks of 64,000
    bytes waited forever for its last block: issue 25.)"""
    total = small = 0
    for t in plan.tasks:
        n = math.prod(t.shape) * t.source.dtype.itemsize
        if n >= PAGE_BLOCK_BYTES:
            total += round_up(n, PAGE) + PAGE
        else:
            total += round_up(max(n, 1), ALIGN)
            small += n
    total += (small // PAGE_BLOCK_BYTES) * 2 * PAGE
    return round_up(total + PAGE, PAGE)


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


__all__ = ["EXTRA_SLOTS", "available_memory_bytes", "round_up", "slot_bytes_for"]
