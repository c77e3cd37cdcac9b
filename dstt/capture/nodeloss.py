"""Recovery after the loss of a node (issue 26): the steps a lost rank's
memory tier held are rebuilt from the copies its partner node keeps
(capture/peerguard.py) and recorded as that rank's, so the recovery every
distributed Capture runs at its start (crashsafe.py: each rank records its
own dead rings, rank 0 commits the steps every rank recorded) commits the
steps every rank sealed -- whichever node is the replacement.

Each copy is a framed block (dstt.format.redundancy): a torn, stale or
corrupted one is refused and named, never used; the rebuilt ring is then
checked like any ring left by a crash (every CRC of its seal record and
pool bytes: a step whose bytes changed is never committed). A copy is
applied only where that rank's record of the step is missing: where the
rank's own node survived, its own ring records the same bytes first or
the copy's record is the same.

Steps that no copy covers (more nodes lost than the scheme covers, or a
copy not yet acknowledged) stay uncommitted: :func:`report_unrebuilt`
names them once, and restores fall back to the newest step in the store.
"""

from __future__ import annotations

import logging
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

from dstt.capture import ranks, stepimage
from dstt.capture import ringowner as O
from dstt.capture.peerguard import copies_group
from dstt.errors import DsttError, NodeLossWarning
from dstt.format import redundancy as RD
from dstt.format import tier as T

log = logging.getLogger("dstt.capture")

#: A copy is one step of one rank's shards: bounded like a ring's files.
MAX_COPY_BYTES = 64 << 30
_RUN_RE = RD._RUN_RE  # (a run id, as the framing checks it)
_RANK_RE = re.compile(r"rank-([0-9]{1,7})")
_STEP_RE = re.compile(r"step-([0-9]{20})\.blk")


class _Delegated:
    """The branch lock, held by rank 0's Capture while this rank records a
    lost rank 0's copies: rank 0 waits in the recovery's collective until
    every rank has recorded, so no other writer runs meanwhile."""

    def check(self) -> None:
        return None

    def release(self) -> None:
        return None


def recover_copies(writer: Any, world: int, base: Path | None = None) -> dict[int, list[int]]:
    """Rebuild, as rings under ``base``, every copy this node keeps of
    ``writer``'s store and branch, and record their steps as their ranks'
    (for a Capture of ``world`` ranks); the steps recorded per rank. Copies
    are removed once recorded; a copy that does not check out is named in
    a warning and removed."""
    group = copies_group(str(writer.backend.url), writer.branch.name, base)
    rebuilt: dict[int, int] = {}
    for run_dir in private_subdirs(group, _RUN_RE):
        for rank_dir in private_subdirs(run_dir, _RANK_RE):
            rank = int(_RANK_RE.fullmatch(rank_dir.name).group(1))  # type: ignore[union-attr]
            for path in sorted(rank_dir.iterdir()):
                m = _STEP_RE.fullmatch(path.name)
                if m is None or (writer.last_step is not None and int(m.group(1)) <= writer.last_step):
                    continue  # (committed already: nothing to rebuild)
                try:
                    data = read_copy(path)
                    _, payload = RD.unframe(data, run=run_dir.name, branch_id=int(writer.branch.id),
                                            step=int(m.group(1)), rank=rank)
                    stepimage.materialize(payload, base)
                    rebuilt[rank] = rebuilt.get(rank, 0) + 1
                except (RD.BlockError, OSError, ValueError) as e:
                    warnings.warn(f"dstt: the copy {path} of rank {rank}'s step {m.group(1).lstrip('0') or 0} "
                                  f"is not used: {e}", NodeLossWarning, stacklevel=2)
    done = {rank: record_as(writer, rank, world, base) for rank in sorted(rebuilt) if rank < world}
    if done:
        log.warning("dstt: rebuilt from the copies on this node (redundancy): %s",
                    "; ".join(f"rank {r}: steps {_names(s)}" for r, s in done.items()))
    shutil.rmtree(group, ignore_errors=True)
    return done


def record_as(writer: Any, rank: int, world: int, base: Path | None) -> list[int]:
    """Record, as rank ``rank``'s (of ``world``), the rebuilt rings of that
    rank under ``base``; the steps recorded. ``writer``'s own rank through
    it; another through a Writer of that rank (rank 0's branch lock
    delegated: rank 0 waits in the recovery's collective meanwhile)."""
    identity = ranks.ring_identity(str(writer.backend.url), writer.branch, rank, world)
    if rank == writer.rank:
        return ranks.record_rings(writer, identity, base=base)
    from dstt.format.writeoptions import WriteOptions
    from dstt.store.writer import Writer

    with Writer(str(writer.backend.url), WriteOptions(branch=writer.branch.name),
                lock=_Delegated() if rank == 0 else None, coordinator=ranks.FixedRank(rank, world)) as other:
        return ranks.record_rings(other, identity, base=base)


def report_unrebuilt(writer: Any) -> list[int]:
    """Rank 0, after the recovery's commits: the steps newer than the last
    commit that some rank sealed (its record is in the store) or that an
    earlier run's tiers said they held (their last published records), and
    that were not committed -- a node that is gone took its part of them,
    and no copy rebuilt it. Named once in a :class:`NodeLossWarning`."""
    last = writer.last_step if writer.last_step is not None else -1
    held: set[int] = set()
    steps: list[int] = []
    try:
        for r in T.read_held(writer.backend, writer.branch.name):
            held.update(s for a, b in r.steps for s in range(max(a, last + 1), min(b, last + 100_000) + 1))
        steps = _partly_recorded(writer.backend, writer.branch.name, last, held)[:10_000]
    except (DsttError, OSError, KeyError, ValueError, TypeError):
        pass
    if steps:
        where = f"step {last}" if last >= 0 else "the start (nothing committed)"
        warnings.warn(f"dstt: steps {_names(steps)} were held in memory by a node that is gone and could not be "
                      f"rebuilt from any copy: the run goes on from {where} in the store", NodeLossWarning,
                      stacklevel=2)
    return steps


def _partly_recorded(backend: Any, branch: str, after: int, candidates: set[int]) -> list[int]:
    """Uncommitted steps after ``after`` (those some rank recorded, and
    ``candidates``) that fewer ranks recorded than the run had: a rank's
    part is missing (a step every rank recorded, with an error on one, is
    a failed step, not a lost one)."""
    from dstt.format import layout as L
    from dstt.format.rankparts import read_record

    prefix = L.steps_prefix(branch).rstrip("/")
    names = {int(d) for d in backend.list_dir(prefix)[:100_000]
             if d.isdigit() and len(d) == L.STEP_DIGITS and int(d) > after}
    out = []
    for step in sorted(names | {s for s in candidates if s > after}):
        d = f"{prefix}/{step:0{L.STEP_DIGITS}d}"
        if backend.exists(f"{d}/{L.COMMIT_FILE}"):
            continue
        ranks_there = [int(n[5:-5]) for n in backend.list_dir(d) if re.fullmatch(r"rank-[0-9]{5,7}\.json", n)]
        if not ranks_there:
            if step in candidates:
                out.append(step)  # held in memory, recorded by nobody
            continue
        rec = read_record(backend, branch, step, ranks_there[0])
        if rec is not None and len(ranks_there) < int(rec["world"]):
            out.append(step)
    return out


def read_copy(path: Path) -> bytes:
    """The bytes of a copy: a regular file of this user, at most MAX_COPY_BYTES
    (read by its size, never a buffer of the bound)."""
    import os
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > MAX_COPY_BYTES:
            raise ValueError(f"{path.name}: not a regular file of this user within {MAX_COPY_BYTES} bytes")
        out = bytearray()
        while len(out) < st.st_size:
            part = os.read(fd, min(st.st_size - len(out), 64 << 20))
            if not part:
                break
            out += part
        return bytes(out)
    finally:
        os.close(fd)


def _names(steps: list[int]) -> str:
    from dstt.format.layout import step_ranges

    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in step_ranges(steps))


def private_subdirs(path: Path, pattern: re.Pattern[str]) -> list[Path]:
    """The private subdirectories of ``path`` whose names match ``pattern``."""
    if not O.private(path):
        return []
    try:
        names = sorted(p.name for p in path.iterdir())
    except OSError:
        return []
    return [path / n for n in names if pattern.fullmatch(n) and O.private(path / n)]


__all__ = ["NodeLossWarning", "private_subdirs", "read_copy", "record_as", "recover_copies", "report_unrebuilt"]
