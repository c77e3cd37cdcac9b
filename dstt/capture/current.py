"""What the parts of a :class:`dstt.Capture` may read of it: :class:`Current`.

A rewind replaces the Capture's ``config`` (its branch), ``writer`` (the new
branch's) and ``committer`` (chosen again for the new branch's ring and
helper). The stager, the crash-safe part and the drain read these three
through this interface -- never the Capture's other attributes -- so each is
built with only what it uses (the ledger, the pool maker, the coordinators
arrive by constructor)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from dstt.capture.committers import Committer
    from dstt.capture.config import CaptureConfig
    from dstt.store.writer import Writer


class Current(Protocol):
    """The Capture's settings, writer and committer as they are now."""

    config: CaptureConfig
    writer: Writer
    committer: Committer


__all__ = ["Current"]
