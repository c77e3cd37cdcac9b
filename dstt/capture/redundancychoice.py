"""``redundancy="auto"`` (issue 26): node protection without naming a scheme.

The choice is made from the state, at the first snapshot, the same on
every rank (the plan's layouts are global, the nodes gathered once):

* ``replicas`` where every tensor is replicated on another node -- each
  region of each layout (a plain tensor under torch.distributed: one
  region held by every rank, as DDP keeps it; an HSDP DTensor: one region
  per shard, held by the ranks along its ``Replicate`` mesh dimensions)
  has holders on at least two nodes; nothing then crosses the network;
* ``pair`` otherwise (some state lives on one node only: FSDP's shards, a
  rank's own tensors): the helpers start copying each node's held steps to
  the next node's.

The first step is planned holding replicas (so either choice finds it
staged as it needs: a ``pair`` choice drops them from the next step on).
The choice is logged, kept as ``Capture.redundancy_chosen`` and written
by rank 0 to ``meta/replicas/<branch>.json`` (dstt.format.replicas).
"""

from __future__ import annotations

import logging
from typing import Any

from dstt import knobs
from dstt.format import replicas as RP
from dstt.store.plan import HOLD_REPLICAS, StepPlan, hold_replicas

log = logging.getLogger("dstt.capture")


class AutoRedundancy:
    """The pending choice of a Capture with ``redundancy="auto"``."""

    def __init__(self, cap: Any) -> None:
        self.cap = cap
        self.nodes: list[str] = list(cap.plan_coord.all_gather(knobs.node_id()))  # (collective: every rank)
        self.chosen: str | None = None
        hold_replicas(cap.writer._layout_cache)  # (the writer plans every step with it)

    def first_plan(self, plan: StepPlan) -> None:
        """Choose from ``plan`` (the first step's), once."""
        if self.chosen is not None:
            return
        alone = RP.replicated_elsewhere(plan.layouts, self.nodes)
        self.chosen = "pair" if alone else "replicas"
        cap = self.cap
        cap.redundancy_chosen = self.chosen
        if alone:
            cap.writer._layout_cache.pop(HOLD_REPLICAS, None)
        helper = cap.crashsafe.helper
        if helper is not None:
            helper.send_command(f"redundancy {self.chosen}", plan.step)
        why = (f"{alone[0]!r}{' and others' if len(alone) > 1 else ''} held on one node only" if alone
               else "every tensor has a replica on another node")
        log.info("dstt: redundancy='auto' chose %r at step %d (%d nodes: %s)", self.chosen, plan.step,
                 len(set(self.nodes)), why)
        if cap.rank == 0:
            try:
                RP.write_choice(cap.writer.backend, cap.writer.branch.name,
                                {"redundancy": self.chosen, "step": plan.step, "why": why,
                                 "nodes": len(set(self.nodes))})
            except Exception as e:  # noqa: BLE001 - the record is informative; the capture goes on
                log.warning("dstt: could not record the redundancy chosen (%s): %s", self.chosen, e)


__all__ = ["AutoRedundancy"]
