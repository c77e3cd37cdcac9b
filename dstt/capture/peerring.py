"""Another rank's staging ring read in place (issue 25: the 2-rank rewind
from memory).

A replicated tensor's chunks are written once, by one of its holders
(store/plan.py), so each rank's ring holds only its share of a step; a
rewind from memory must restore all of it on every rank. Ranks on the same
host read the other ranks' shares straight from their pool files in
/dev/shm, mapped (no byte crosses gloo, no copy but the restore's own);
ranks on other hosts, or where anything below does not check out, get them
over gloo (capture/rewindpeers.py).

**Same host, proven, never assumed.** The owner of a ring states, through
the ranks' all-gather (an :class:`Offer`), its host (host name and node id,
boot id), its ring directory, its pool file's device and inode, and the
name of a *lease* it has just written in its ring for this rewind
(``rewind-<step>-<nonce>.json``, holding that nonce). The reader maps the
pool only if its own host and boot are the same, the ring directory lies
under its own ring root, the lease there is a regular file of this user
holding the owner's nonce, and the pool file it opens (no symlink
followed) is a regular file of this user with the device and inode the
owner stated, large enough for every chunk. Anything else: not mapped
(:func:`open_peer` says why).

**Untrusted, bounded.** Every chunk's place is checked against the pool
file's size and against the step's layouts (the tensor exists, the box
lies inside it, the bytes match its shape and dtype) before any view is
made; the lease is read with a bounded read.

**Changed while read.** The owner holds the step for the whole rewind
(its capture helper's ``hold``; its trainer does not stage again before
the rewind's last collective), and removes its lease only after that
collective. A lease that is gone or rewritten when the reader has copied
the chunks (:meth:`PeerMap.unchanged`) means the owner let the step go:
the reader takes those chunks again over gloo (rewindpeers.py).
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import socket
import stat
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dstt import knobs
from dstt.capture import ringowner as O

log = logging.getLogger("dstt.capture")

#: A lease is ~100 bytes; anything bigger is not ours.
LEASE_MAX_BYTES = 4096
LEASE_PREFIX = "rewind-"
PAGE = mmap.PAGESIZE

#: (tensor name, chunk offset, chunk shape, dtype, byte start in the pool file, bytes)
Chunk = tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype, int, int]


def host_identity() -> dict[str, Any]:
    """What "the same host" means here: host name, node id (DSTT_NODE_ID:
    ranks simulating other nodes are other hosts) and boot id."""
    return {"host": socket.gethostname(), "node": knobs.node_id(), "boot": O.process_identity()["boot"]}


@dataclass
class Offer:
    """What a rank's ring holds of a step's replicated chunks, and where
    (None fields: not readable in place -- no ring, no lease)."""

    chunks: list[Chunk]
    host: dict[str, Any] = field(default_factory=dict)
    ring: str | None = None
    pool: str | None = None
    pool_id: tuple[int, int] | None = None  # (st_dev, st_ino) as the owner sees it
    lease: str | None = None
    nonce: str | None = None


def write_lease(ring_dir: Path, step: int) -> tuple[Path, str]:
    """The owner's lease on ``step``'s slot for one rewind, written
    atomically in its ring: (its path, its nonce). OSError if it cannot be."""
    nonce = uuid.uuid4().hex
    path = ring_dir / f"{LEASE_PREFIX}{step}-{nonce[:12]}.json"
    tmp = path.with_name(path.name + ".tmp")
    data = json.dumps({"step": step, "nonce": nonce, "pid": os.getpid()}).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path, nonce


def drop_lease(path: Path | None) -> None:
    """Remove a lease (after the rewind's last collective)."""
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass


def _file_id(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class PeerMap:
    """A peer's pool file mapped here (private, read-only use: nothing is
    written to it), with the views of the chunks asked for."""

    views: list[torch.Tensor]
    lease: Path
    lease_id: tuple[int, int, int, int]
    pool: Path
    pool_id: tuple[int, int]

    def unchanged(self) -> bool:
        """Whether the owner's lease is still the one read before the copy
        (same file, same bytes: not removed or rewritten) and its pool the
        same file: the chunks copied from it are the step's."""
        try:
            lease = os.lstat(self.lease)
            pool = os.lstat(self.pool)
        except OSError:
            return False
        return _file_id(lease) == self.lease_id and (pool.st_dev, pool.st_ino) == self.pool_id

    def close(self) -> None:
        """Let go of the views (the mapping goes with the last of them)."""
        self.views = []


#: Injection point for tests: called as ``after_map(peer_map)`` once a
#: peer's chunks are mapped, before they are copied.
after_map: Callable[[PeerMap], None] | None = None


def open_peer(offer: Offer, want: list[int], layouts: dict[str, Any], root: Path | None = None,
              here: dict[str, Any] | None = None) -> tuple[PeerMap | None, str]:
    """Map the chunks ``want`` (indices into ``offer.chunks``) of a peer's
    ring: (the map, "") or (None, why not). Every check of the module
    docstring; ``layouts``: the step's TensorLayouts by name."""
    if offer.ring is None or offer.pool is None or offer.pool_id is None or offer.lease is None or not offer.nonce:
        return None, "its ring cannot be read in place (no staging ring, or no lease)"
    me = here if here is not None else host_identity()
    if not me.get("boot") or any(offer.host.get(k) != me[k] for k in ("host", "node", "boot")):
        return None, f"it runs on another host ({offer.host.get('host')!r}, node {offer.host.get('node')!r})"
    ring = Path(offer.ring)
    own_root = O.ring_root(root)
    try:
        inside = ring.resolve(strict=True).is_relative_to(own_root.resolve(strict=True))
    except OSError:
        inside = False
    if not inside or not _plain_name(offer.pool) or not _plain_name(offer.lease):
        return None, f"its ring {offer.ring} is not under this host's ring root {own_root}"
    lease = ring / offer.lease
    try:
        lease_id = _file_id(os.lstat(lease))
        doc = json.loads(O.read_regular(lease, LEASE_MAX_BYTES))
    except (OSError, ValueError) as e:
        return None, f"its lease {lease} cannot be read here ({e})"
    if not isinstance(doc, dict) or doc.get("nonce") != offer.nonce:
        return None, f"its lease {lease} is not the one it wrote"
    chunks = [offer.chunks[i] for i in want]
    problem = _check_chunks(chunks, layouts)
    if problem:
        return None, problem
    pool = ring / offer.pool
    try:
        fd = os.open(pool, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        return None, f"its pool file {pool} cannot be opened here ({e})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or (st.st_dev, st.st_ino) != offer.pool_id:
            return None, f"{pool} is not the pool file it stated"
        lo = min((c[4] for c in chunks), default=0) // PAGE * PAGE
        hi = max((c[4] + c[5] for c in chunks), default=0)
        if hi > st.st_size:
            return None, f"a chunk lies past the end of {pool} ({hi} > {st.st_size} bytes)"
        # Private and never written: its pages are the owner's (no copy), and
        # no write of ours could ever reach the owner's file.
        mm = mmap.mmap(fd, hi - lo, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE, offset=lo) if hi > lo \
            else None
    except OSError as e:
        return None, f"its pool file {pool} cannot be mapped here ({e})"
    finally:
        os.close(fd)
    flat = torch.frombuffer(mm, dtype=torch.uint8) if mm is not None else torch.empty(0, dtype=torch.uint8)
    views = [flat[start - lo:start - lo + n].view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)
             for _, _, shape, dtype, start, n in chunks]
    got = PeerMap(views, lease, lease_id, pool, offer.pool_id)
    if after_map is not None:
        after_map(got)
    return got, ""


def _plain_name(name: str) -> bool:
    return bool(name) and "/" not in name and name not in (".", "..") and "\0" not in name


def _check_chunks(chunks: list[Chunk], layouts: dict[str, Any]) -> str:
    """"" if every chunk is a box of a tensor of the step whose bytes match
    its shape and dtype, else what is wrong (the first)."""
    for name, off, shape, dtype, start, n in chunks:
        layout = layouts.get(name)
        if layout is None:
            return f"a chunk of a tensor {name!r} the step does not have"
        dims = tuple(layout.shape)
        if len(off) != len(dims) or len(shape) != len(dims) or any(
                o < 0 or s < 0 or o + s > d for o, s, d in zip(off, shape, dims)):
            return f"a chunk {off}+{shape} of {name!r} outside its shape {dims}"
        if not isinstance(dtype, torch.dtype) or dtype.itemsize != layout.dtype.itemsize:
            return f"a chunk of {name!r} of another element size than its dtype {layout.dtype.logical}"
        size = dtype.itemsize
        if start < 0 or n != math.prod(shape) * size or start % size:
            return f"a chunk of {name!r} of {n} bytes at {start}: not its shape and dtype"
    return ""


__all__ = ["Chunk", "LEASE_PREFIX", "Offer", "PeerMap", "after_map", "drop_lease", "host_identity", "open_peer",
           "write_lease"]
