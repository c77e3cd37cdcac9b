"""Skip records: which steps a ``Capture`` with ``on_full="skip"`` dropped.

A skipped step leaves ``meta/skips/<branch>/<step:020d>.json`` (written
atomically by rank 0, in step order with the commits)::

    {"format": "dstt-skip", "branch": "main", "step": 7,
     "reason": "staging pool full: ...", "time": 1718000000.0}

It is not a step: ``Run.steps()`` does not list it.
"""

from __future__ import annotations

import time
from typing import Any

from dstt.errors import CorruptStoreError
from dstt.format import layout as L
from dstt.format.backends import Backend, open_backend
from dstt.format.manifest import parse_skip, skip_document

# Where records live and what they hold is format knowledge:
# dstt.format.layout.skip_key and dstt.format.manifest.parse_skip/skip_document.


def write_skip(backend: Backend, branch: str, step: int, reason: str) -> None:
    backend.put_atomic(L.skip_key(branch, step), skip_document(branch, step, reason, time.time()))


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
    for name in backend.list_dir(L.skips_prefix(branch).rstrip("/")):
        if not name.endswith(".json"):
            continue
        key = L.skips_prefix(branch) + name
        data = backend.get(key, max_bytes=L.MAX_DOC_BYTES)
        if data is not None:
            doc = parse_skip(data, key, branch)  # the store may be someone else's: validated
            if key != L.skip_key(branch, doc["step"]):
                raise CorruptStoreError(f"{key}: skip record of step {doc['step']} under another step's name")
            out[doc["step"]] = doc
    return dict(sorted(out.items()))
