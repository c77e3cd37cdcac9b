"""Lazy asynchronous capture (``dstt.Capture``); see docs/capture.md."""

from dstt.capture.config import CaptureConfig
from dstt.capture.engine import Capture
from dstt.capture.records import skipped_steps

__all__ = ["Capture", "CaptureConfig", "skipped_steps"]
