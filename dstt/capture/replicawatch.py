"""redundancy="replicas" in a capture helper (issue 26): which held steps
count as protected while training, published as ``pair`` and
``parity:k`` publish theirs (``dstt ls`` shows them).

Nothing is sent: with ``replicas`` each rank's ring already holds the
replicated chunks the other holders write, marked ``[owner, shard]`` in its
seal records (dstt.format.replicas). This helper learns every rank's node
(through the same mailbox ``pair`` uses) and, for each step its tier
holds, judges its own seal record (dstt.format.replicapieces.unprotected):
its ring holds every chunk it should hold for the others, and each region
it holds has a holder on another node. It publishes the held steps that
pass in its protection record; a step is protected once every rank's
record of the run names it (format.redundancy.protected_steps): every
rank's part of it is then in the ring of a live holder on another node.
A step that leaves a tier leaves that rank's record, and so the protected
steps.
"""

from __future__ import annotations

import logging

from dstt.capture.peerguard import PeerGuard
from dstt.format.replicapieces import unprotected

log = logging.getLogger("dstt.capture")


class ReplicaGuard(PeerGuard):
    """One helper's part of ``redundancy="replicas"`` (module docstring):
    a PeerGuard that sends and keeps nothing, and acknowledges its own held
    steps whose seal records count toward protection."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._judged: dict[int, str | None] = {}  # step -> why it does not count (None: it counts)
        self._said: str | None = None

    def _place(self) -> bool:
        nodes = self._learn_nodes()
        if nodes is None:
            return False
        self.nodes = nodes
        return True

    def _sends(self) -> bool:
        return False

    def _publish(self, held: list[int], force: bool) -> None:
        now = set(held)
        for step in held:
            if step not in self._judged:
                self._judged[step] = self._judge(step)
        self._judged = {s: why for s, why in self._judged.items() if s in now}
        self.acked = {s for s, why in self._judged.items() if why is None}
        super()._publish(held, force)

    def _judge(self, step: int) -> str | None:
        entry = self.ops.steps.get(step)
        if entry is None or self.nodes is None:
            return "not held"
        plan, record = entry
        why = unprotected(plan.layouts, record["tasks"]["static"], self.rank, self.nodes)
        if why is not None and why != self._said:  # (said once while the reason stays the same)
            log.warning("dstt helper (rank %d): step %d is not protected by its replicas: %s", self.rank, step,
                        why)
        self._said = why
        return why


__all__ = ["ReplicaGuard"]
