"""Skip records: which steps a ``Capture`` with ``on_full="skip"`` dropped.

A skipped step leaves ``meta/skips/<branch>/<step:020d>.json`` (written
atomically by rank 0, in step order with the commits)::

    {"format": "dstt-skip", "branch": "main", "step": 7,
     "reason": "staging pool full: ...", "time": 1718000000.0}

It is not a step: ``Run.steps()`` does not list it.
"""

from __future__ import annotations

import json
import time
from typing import Any

from dstt.errors import CorruptStoreError
from dstt.store import layout as L
from dstt.store.backends import Backend, open_backend
from dstt.store.manifest import decode_json

SKIPS = f"{L.META}/skips"


def skip_key(branch: str, step: int) -> str:
    return f"{SKIPS}/{branch}/{step:0{L.STEP_DIGITS}d}.json"


def write_skip(backend: Backend, branch: str, step: int, reason: str) -> None:
    doc = {"format": "dstt-skip", "branch": branch, "step": step, "reason": reason, "time": time.time()}
    backend.put_atomic(skip_key(branch, step), json.dumps(doc).encode())


def skipped_steps(store: Any, branch: str = "main") -> dict[int, dict[str, Any]]:
    """Steps the skip policy dropped on ``branch``, with their records.

    >>> import tempfile, dstt
    >>> path = tempfile.mkdtemp() + "/run"
    >>> with dstt.Capture(path) as cap: pass
    >>> skipped_steps(path)
    {}
    """
    backend = open_backend(store)
    L.validate_branch(branch)
    out: dict[int, dict[str, Any]] = {}
    for name in backend.list_dir(f"{SKIPS}/{branch}"):
        if not name.endswith(".json"):
            continue
        key = f"{SKIPS}/{branch}/{name}"
        data = backend.get(key, max_bytes=L.MAX_DOC_BYTES)
        if data is not None:
            doc = decode_json(data, key)  # the store may be someone else's: validate
            step = doc.get("step") if isinstance(doc, dict) else None
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise CorruptStoreError(f"{key}: not a skip record (no non-negative integer step)")
            out[step] = doc
    return dict(sorted(out.items()))
