"""``redundancy="parity:k"`` in the capture helpers (issue 26): each
helper sends the stripes of its held steps' images to the other members
of its parity group, and keeps the XOR parity of theirs; a step counts
as protected once every other member's parity of it is complete.

A group is ``k + 1`` nodes (dstt.format.redundancy.parity_groups), one
rank of each: the ranks at the same position on their nodes. Member ``i``
cuts its step image (capture/stepimage.py: the bytes its ring holds for
the step, encoded where encoded) into ``k`` stripes, one per other
member, and sends each, framed (dstt.format.parityacc.stripe_block),
the way ``pair`` sends its blocks (capture/peerguard.py: point to point
over the helpers' gloo group, capture/transport.py; control records in
the job's c10d TCPStore; every call bounded) under
``pst/<src>/<dst>/<n>``. Each member XORs the stripes it is sent as they arrive (dstt.format.parityacc:
torn, stale and duplicate stripes refused or ignored, only the parity
kept: ``1/k`` of an image per step), writes the complete parity framed
to its node-local memory directory (``<DSTT_SHM_DIR or /dev/shm>/
dstt-<uid>-parity/<group>/<run>/rank-<r>/step-<step>.par``) and
acknowledges it to every contributor (``pack/<src>/<step>/<holder>``).
A member's step is protected once all ``k`` other members acknowledged
it; the protection record and ``dstt ls`` say so as for ``pair``.

Never blocks the trainer (it runs in the helper's loop, the trainer only
seals); every mailbox call is bounded; a failure turns redundancy off for
this helper with one warning. Recovery: capture/parityrecover.py.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path
from typing import Any

from dstt.capture import ringowner as O
from dstt.capture.peerguard import PeerGuard, post_block, take_block
from dstt.format import parityacc as PA
from dstt.format import redundancy as RD

log = logging.getLogger("dstt.capture")

_PAR_RE = re.compile(r"step-([0-9]{20})\.par")


def parity_root(base: Path | None = None) -> Path:
    return O.shm_base(base) / f"dstt-{os.getuid()}-parity"


def parity_group(store_url: str, branch: str, base: Path | None = None) -> Path:
    """Where this node keeps the parities of a store's branch."""
    return parity_root(base) / hashlib.sha256(f"{store_url}\0{branch}".encode()).hexdigest()[:24]


def parity_file(run_dir: Path, holder: int, step: int) -> Path:
    return run_dir / f"rank-{holder}" / f"step-{step:020d}.par"


def group_members(nodes: list[int], rank: int, k: int, m: int = 1) -> list[int]:
    """The ranks of ``rank``'s parity group (in group order) given each
    rank's node; ``[]`` where there is none (one node, at most ``m`` nodes,
    or nodes of the group with different rank counts: its steps stay
    unprotected).

    >>> group_members([0, 0, 1, 1, 2, 2], 3, 2)
    [1, 3, 5]
    >>> group_members([0, 1, 2, 3], 2, 2, 2), group_members([0, 1], 0, 2, 2)
    ([0, 1, 2, 3], [])
    """
    n_nodes = max(nodes) + 1
    if n_nodes < 2:
        return []
    mine = next(g for g in RD.parity_groups(n_nodes, k, m) if nodes[rank] in g)
    on = {n: [r for r in range(len(nodes)) if nodes[r] == n] for n in mine}
    if len({len(v) for v in on.values()}) != 1 or len(mine) <= m:
        return []
    at = on[nodes[rank]].index(rank)
    return [on[n][at] for n in mine]


class ParityGuard(PeerGuard):
    """One helper's part of ``redundancy="parity:k"`` (see the module docstring)."""

    def __init__(self, scheme: RD.Scheme, run: str, rank: int, world: int, ops: Any, writer: Any,
                 mailbox: Any) -> None:
        super().__init__(scheme, run, rank, world, ops, writer, mailbox)
        self.members: list[int] = []
        self.acc: Any = None  # (a ParityAccumulator, or rsgroup's RSAccumulator)
        self.out_seq: dict[int, int] = {}
        self.in_seq: dict[int, int] = {}
        self.answers: dict[int, set[int]] = {}  # pending step -> members whose parity of it is complete
        self.run_dir = parity_group(str(writer.backend.url), writer.branch.name) / run
        self.pdir = self.run_dir / f"rank-{rank}"
        self.cut = -1

    def close(self, clean: bool) -> None:
        self.pump([], force=True)
        self.close_box(clean)
        if clean:
            import shutil

            shutil.rmtree(self.run_dir, ignore_errors=True)
            for parent in (self.run_dir.parent, self.run_dir.parent.parent):
                try:
                    parent.rmdir()
                except OSError:
                    break

    # ------------------------------------------------------------ placement

    def _place(self) -> bool:
        """Learn every helper's node (bounded), then this rank's group."""
        nodes = self._learn_nodes()
        if nodes is None:
            return False
        self.nodes = nodes
        self.members = group_members(nodes, self.rank, self.scheme.k, self.scheme.m)
        if not self.members:
            log.warning("dstt helper (rank %d): redundancy=%r needs at least %d nodes with as many ranks each in "
                        "a group; this job has not: its steps are unprotected", self.rank, str(self.scheme),
                        self.scheme.m + 1)
            return True
        self.acc = self._accumulator()
        others = [m for m in self.members if m != self.rank]
        self.out_seq = {m: 0 for m in others}
        self.in_seq = {m: 0 for m in others}
        self.holder = others[0]  # (non-None: this rank sends)
        return True

    def _accumulator(self) -> Any:
        """What keeps this rank's parity of the others' stripes (XOR here; capture/rsgroup.py: Reed-Solomon)."""
        return PA.ParityAccumulator(self.run, self.branch_id, self.rank, self.members)

    # ------------------------------------------------------------ sending

    def _sends(self) -> bool:
        return bool(self.members)

    def _post(self, step: int, image: bytes) -> None:
        """Send ``step``'s image cut in stripes, one to each other member."""
        for h in self.out_seq:
            data = PA.stripe_block(image, run=self.run, branch_id=self.branch_id, step=step, src=self.rank,
                                   holder=h, members=self.members)
            post_block(self.box, f"pst/{self.rank}/{h}/{self.out_seq[h]}", data, dst=h)
            self.out_seq[h] += 1
            self.bytes_sent += len(data)
        self.answers[step] = set()

    def _acks(self) -> bool:
        did = False
        for step in sorted(self.pending):
            got = self.answers.setdefault(step, set())
            for h in self.out_seq:
                if h in got:
                    continue
                answer = self.box.take(f"pack/{self.rank}/{step}/{h}")
                if answer is None:
                    continue
                did = True
                if answer != b"ok":
                    log.warning("dstt helper (rank %d): rank %d could not keep the parity of step %d: %s",
                                self.rank, h, step, answer[:200].decode(errors="replace"))
                    self.pending.discard(step)
                    break
                got.add(h)
            if step in self.pending and got == set(self.out_seq):
                self.pending.discard(step)
                self.acked.add(step)
        gone = {s for s in self.pending if s < self.low_sent}  # (left the tier unprotected: forgotten)
        self.pending -= gone
        self.answers = {s: a for s, a in self.answers.items() if s in self.pending}
        self.acked = {s for s in self.acked if s >= self.low_sent}
        return did

    # ------------------------------------------------------------ keeping parity

    def _receive(self) -> bool:
        if self.acc is None:
            return False
        did = False
        for src in self.in_seq:
            data = take_block(self.box, f"pst/{src}/{self.rank}/{self.in_seq[src]}")
            if data is None:
                continue
            self.in_seq[src] += 1
            did = True
            try:
                what, step = self.acc.add(data, src)
            except RD.BlockError as e:
                log.warning("dstt helper (rank %d): a stripe of rank %d refused: %s", self.rank, src, e)
                continue
            if what == "complete":
                self._keep(step)
        self._drop()
        return did

    def _keep(self, step: int) -> None:
        """Write ``step``'s complete parity and acknowledge it to every contributor."""
        assert self.acc is not None
        data = self.acc.complete(step)
        try:
            for d in (parity_root(), self.run_dir.parent, self.run_dir, self.pdir):
                O.make_private(d)
            O.write_atomic(parity_file(self.run_dir, self.rank, step), data or b"")
            answer = b"ok"
        except OSError as e:
            answer = f"not kept: {e}".encode()
        for src in self.in_seq:
            self.box.put(f"pack/{src}/{step}/{self.rank}", answer)

    def _drop(self) -> None:
        """Forget parities below the newest of the members' oldest held steps:
        a member no longer holds its image of them, so they rebuild nothing."""
        lows = [self.box.peek(f"low/{m}") for m in self.in_seq]
        cut = max([int(x) for x in lows if x is not None and x.isdigit() and len(x) <= 20] + [self.low_sent])
        if cut <= self.cut or self.acc is None:
            return
        self.cut = cut
        self.acc.drop_below(cut)
        try:
            names = os.listdir(self.pdir)
        except OSError:
            return
        for name in names:
            m = _PAR_RE.fullmatch(name)
            if m and int(m.group(1)) < cut:
                try:
                    os.unlink(self.pdir / name)
                except OSError:
                    pass


__all__ = ["ParityGuard", "group_members", "parity_file", "parity_group", "parity_root"]
