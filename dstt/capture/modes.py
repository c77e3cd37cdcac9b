"""The one choice of a Capture's mode (issue 24's committers, issue 25's
memory tier in the capture helper): which committer stores its steps.

* ``memory_steps``: the memory tier -- in the capture helper process where
  it can run (:class:`~dstt.capture.tiercommitter.HelperTierCommitter`:
  the trainer only copies and seals), else in this process
  (:class:`~dstt.capture.committers.TierCommitter`), said with a
  ``MemoryTierWarning`` unless ``helper=False`` asked for it; under
  torch.distributed only in the helpers (the ranks agree through them);
* else the capture helper where it can run, else this process.
"""

from __future__ import annotations

import logging
import uuid
import warnings
from typing import Any

from dstt.capture.committers import Committer, HelperCommitter, InProcessCommitter, TierCommitter
from dstt.capture.redundancychoice import AutoRedundancy
from dstt.capture.tiercommitter import HelperTierCommitter
from dstt.errors import CaptureWarning, ConfigError, MemoryTierWarning
from dstt.store.plan import hold_replicas

log = logging.getLogger("dstt.capture")


def make_committer(cap: Any) -> Committer:
    """The committer of ``cap``'s mode (see the module docstring). Called by
    the constructor, and when a rewind opens a new branch (its ring and
    helper are per branch). The one place that tells the modes apart."""
    cfg = cap.config
    if cfg.memory_steps is not None:
        tier = {"k": cfg.memory_steps, "policy": cfg.persist_policy, "watch": cfg.watch_nonfinite,
                "run": cap.crashsafe.run_id or uuid.uuid4().hex,
                # ("replicas": the trainer stages, the helpers only publish what is protected;
                # "auto" tells them what it chooses)
                "redundancy": "none" if cfg.redundancy == "auto" else cfg.redundancy}
        if cfg.redundancy != "none" and not cap.plan_coord.distributed:
            raise ConfigError(f"redundancy={cfg.redundancy!r} copies steps between the nodes of a "
                              "torch.distributed job; this Capture runs alone")
        if cfg.redundancy == "replicas":  # stage the replicated chunks other holders write too (issue 26)
            hold_replicas(cap.writer._layout_cache)  # (the writer plans every step with it)
        cap.redundancy_auto = AutoRedundancy(cap) if cfg.redundancy == "auto" else None  # (chosen at step 1)
        helper = None if cfg.helper is False else cap.crashsafe.start_helper(tier=tier)
        if helper is not None:
            cap.crashsafe.helper = helper
            cap.tier_where = "helper"
            return HelperTierCommitter(cap, helper)
        if cap.plan_coord.distributed:
            raise ConfigError("memory_steps under torch.distributed needs the capture helper on every rank "
                              "(/dev/shm and a local store): the ranks' memory tiers agree through their helpers")
        if cfg.helper is None:  # (helper=False asked for it: said in the log only)
            warnings.warn("dstt: the memory tier runs in the trainer's process (no capture helper can run here: "
                          "it needs /dev/shm and a local store given by its path): its writer and NaN/Inf watcher "
                          "share the training loop's CPU and GIL", MemoryTierWarning, stacklevel=4)
        log.info("dstt: the memory tier runs in the trainer's process (helper=%s)", cfg.helper)
        cap.tier_where = "trainer"
        return TierCommitter(cap)
    helper = cap.crashsafe.helper = cap.crashsafe.start_helper()
    if helper is not None:
        return HelperCommitter(cap, helper)
    if cfg.compression in ("predictive", "auto"):
        # Coding needs the whole step; in this process the flush threads
        # write each chunk as its copy lands, beside the training loop
        # (benchmarks/bench_inprocess_code.py measures what coding there
        # would cost it): each chunk stored whole, compressed on its own.
        warnings.warn(f"dstt: compression={cfg.compression!r} codes steps in the capture helper; this capture "
                      "writes in the trainer's process (helper=False, or no helper can run here), so its "
                      "chunks are stored whole, each compressed on its own", CaptureWarning, stacklevel=4)
    return InProcessCommitter(cap)


__all__ = ["make_committer"]
