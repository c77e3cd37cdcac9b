"""The peer-redundancy guard of a capture helper (issue 26): the one
``redundancy=`` asks for -- ``pair`` (capture/peerguard.py) or
``parity:k`` (capture/paritygroup.py), ``parity:k+m`` (capture/rsgroup.py)
-- or None."""

from __future__ import annotations

from typing import Any

from dstt.capture import peerguard
from dstt.format.redundancy import parse_scheme


def start(tier_args: dict[str, Any], records: Any, writer: Any, ops: Any) -> peerguard.PeerGuard | None:
    """This helper's guard, of the scheme's kind (see :func:`dstt.capture.peerguard.start`)."""
    text = tier_args.get("redundancy")
    scheme = parse_scheme(text) if text and text != "none" else None
    if scheme is not None and scheme.kind == "parity":
        from dstt.capture.paritygroup import ParityGuard
        from dstt.capture.rsgroup import RSGuard

        return peerguard.start(tier_args, records, writer, ops, kind=RSGuard if scheme.m > 1 else ParityGuard)
    return peerguard.start(tier_args, records, writer, ops)


__all__ = ["start"]
