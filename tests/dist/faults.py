"""Faults injected into one rank's trainer or capture helper (tests/system/test_dist_failure.py).

A fault is armed by a file ``$DSTT_TEST_FAULTS/<kind>`` holding
``<rank> <process>`` (process: ``trainer``, ``helper`` or ``any``) and
disarmed by removing it; every patched call looks, so a test arms and
disarms between steps. The trainer calls :func:`install`; its capture
helpers (exec'ed interpreters) get it from tests/dist/hook/sitecustomize.py
through PYTHONPATH. The rank is torchrun's ``RANK`` (helpers inherit it).

Kinds: ``chunk-put`` (chunk and pack writes fail with ENOSPC),
``index-put`` (a step's index.json write fails with ENOSPC),
``record-put`` (a rank record's write fails with ENOSPC), ``sync`` (the
store's sync raises RuntimeError), ``unpicklable`` (a settled chunk result
carries a lock: what 87d87fd fixed, the class of "a payload that cannot be
sent to rank 0"), ``plan`` (read by fail_steps.py: the rank's state holds an
object it may not pickle, so its snapshot() fails while planning).
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from pathlib import Path
from typing import Any


def _process() -> str:
    argv = " ".join(sys.argv)
    return "helper" if "dstt.capture.helper" in argv or "capture/helper.py" in argv else "trainer"


def armed(kind: str) -> bool:
    base = os.environ.get("DSTT_TEST_FAULTS")
    if not base:
        return False
    try:
        rank, proc = (Path(base) / kind).read_text().split()
    except (OSError, ValueError):
        return False
    return rank == os.environ.get("RANK", "0") and proc in ("any", _process())


def arm(base: Path, kind: str, rank: int, proc: str) -> None:
    (base / kind).write_text(f"{rank} {proc}")


def disarm(base: Path, kind: str) -> None:
    (base / kind).unlink(missing_ok=True)


def _enospc(key: str) -> OSError:
    return OSError(errno.ENOSPC, f"No space left on device (injected, rank {os.environ.get('RANK')}): {key}")


def install() -> None:
    from dstt.format.backends import LocalBackend
    from dstt.format.commit import ChunkResult

    put, put_atomic, sync, settled = (LocalBackend.put, LocalBackend.put_atomic, LocalBackend.sync,
                                      ChunkResult.settled)

    def is_chunk(key: str) -> bool:
        return key.startswith("tensors/") and "/c." in key or key.startswith("packs/p.")

    def put_(self: Any, key: str, data: Any) -> None:
        if (is_chunk(key) and armed("chunk-put")) or (key.endswith("/index.json") and armed("index-put")):
            raise _enospc(key)
        put(self, key, data)

    def put_atomic_(self: Any, key: str, data: Any) -> None:
        if "/rank-" in key and armed("record-put"):
            raise _enospc(key)
        if (is_chunk(key) and armed("chunk-put")) or (key.endswith("/index.json") and armed("index-put")):
            raise _enospc(key)
        put_atomic(self, key, data)

    def sync_(self: Any) -> None:
        if armed("sync"):
            raise RuntimeError(f"sync failed (injected, rank {os.environ.get('RANK')})")
        sync(self)

    def settled_(self: Any) -> Any:
        out = settled(self)
        if armed("unpicklable"):
            from dataclasses import replace

            out = replace(out)
            out.__dict__["lock"] = threading.RLock()  # cannot be pickled
        return out

    LocalBackend.put, LocalBackend.put_atomic, LocalBackend.sync = put_, put_atomic_, sync_  # type: ignore[method-assign]
    ChunkResult.settled = settled_  # type: ignore[method-assign]
