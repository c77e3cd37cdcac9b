"""Lazy asynchronous capture (``dstt.Capture``); see docs/capture.md.

The names load on first access, so that the capture helper process
(``python -m dstt.capture.helper``) imports only what serving needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dstt.capture.config import CaptureConfig
    from dstt.capture.engine import Capture
    from dstt.format.skips import skipped_steps

__all__ = ["Capture", "CaptureConfig", "skipped_steps"]

_WHERE = {"Capture": "dstt.capture.engine", "CaptureConfig": "dstt.capture.config",
          "skipped_steps": "dstt.format.skips"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'dstt.capture' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
