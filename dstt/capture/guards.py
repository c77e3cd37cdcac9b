"""The peer-redundancy guard of a capture helper (issue 26): the one
``redundancy=`` asks for -- ``pair`` (capture/peerguard.py),
``parity:k`` (capture/paritygroup.py) or ``replicas`` (capture/replicawatch.py)
-- or None."""

from __future__ import annotations

from typing import Any

from dstt.capture import peerguard
from dstt.format.redundancy import parse_scheme


def start(tier_args: dict[str, Any], records: Any, writer: Any, ops: Any) -> peerguard.PeerGuard | None:
    """This helper's guard, of the scheme's kind (see :func:`dstt.capture.peerguard.start`)."""
    text = tier_args.get("redundancy")
    if text and text != "none" and parse_scheme(text).kind == "parity":
        from dstt.capture.paritygroup import ParityGuard

        return peerguard.start(tier_args, records, writer, ops, kind=ParityGuard)
    if text == "replicas":  # (nothing sent: the protection its seals give, published)
        from dstt.capture.replicawatch import ReplicaGuard

        return peerguard.start(tier_args, records, writer, ops, kind=ReplicaGuard)
    return peerguard.start(tier_args, records, writer, ops)


__all__ = ["start"]
