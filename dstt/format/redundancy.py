"""Peer redundancy of the memory tier (issue 26), torch-free: the schemes,
where each node's copies or parity go, the framing of every block that
crosses the network, XOR parity, and the protection records in the store.

A *node* is the ranks sharing a host (``socket.gethostname()``, or
``DSTT_NODE_ID``: one machine can stand for several). Schemes:

* ``none``: a node's loss takes the steps only its memory held;
* ``pair``: node ``n``'s step images are copied to node ``(n + 1) % N``
  (a ring: any N >= 2; one loss never takes a step and its copy);
* ``parity:k``: groups of ``k + 1`` nodes; each member's block of a step
  is cut into ``k`` pieces, and member ``t`` holds the XOR of the other
  members' ``t``-th stripes (RAID-5 over nodes): ``1/k`` of a node's tier
  in extra memory, any one member of a group rebuilt from the others;
* ``parity:k+m`` (``m >= 2``): groups of ``k + m`` nodes, Reed-Solomon
  through pyeclib (dstt.format.rsacc): ``m/k`` of a node's tier in extra
  memory, any ``m`` members of a group rebuilt at once;
* ``replicas``: the ranks whose trainers hold identical state (DDP, HSDP)
  as each other's copies -- each ring also stages the replicated chunks
  other holders write (dstt.format.replicas, capture/replicaguard.py).

Every block is framed (:func:`frame`): magic, the header's own CRC-32C, the
run, branch id, step, source rank, kind, the payload's length and CRC-32C;
:func:`unframe` refuses a torn, stale (another step, run or branch) or
corrupted one with :class:`BlockError`, never returns its bytes.

>>> partner(0, 3), partner(2, 3)
(1, 0)
>>> parity_groups(7, 2)
[[0, 1, 2], [3, 4, 5, 6]]
>>> blocks = [b"abc", b"de", b"fghij"]
>>> parity = encode_parity(blocks, 0)   # member 0 of the group holds the XOR of stripes 0 of the others
>>> len(parity)
3
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from dstt.errors import ConfigError, CorruptStoreError, DsttError
from dstt.format import layout as L
from dstt.format.codecs.spec import crc32c
from dstt.format.manifest import decode_json, encode_json
from dstt.format.tier import read_rank_records

#: The schemes ``redundancy=`` accepts (``parity:k`` with 1 <= k <= MAX_K;
#: ``parity:k+m`` with 2 <= m <= MAX_M, k + m <= MAX_RS_GROUP).
SCHEMES = ("none", "pair", "replicas", "parity:k", "parity:k+m")
MAX_K = 64
MAX_M = 8
MAX_RS_GROUP = 32
MAGIC = b"DSTTRB01"
_HEAD = struct.Struct("<8sII")  # magic, header length, header CRC-32C
#: A header is a few hundred bytes; anything bigger is not one.
MAX_HEADER_BYTES = 1 << 16
KINDS = ("copy", "parity", "stripe", "fragment")
_RUN_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


class BlockError(DsttError, ValueError):
    """A block (copy or parity) that is torn, stale or corrupted: never trusted."""


@dataclass(frozen=True)
class Scheme:
    """A parsed ``redundancy=`` value."""

    kind: str  # none, pair, replicas, parity
    k: int = 0  # parity: data pieces per parity block
    m: int = 1  # parity: parity pieces (1: XOR; more: Reed-Solomon, dstt.format.rsacc)

    def __str__(self) -> str:
        if self.kind != "parity":
            return self.kind
        return f"parity:{self.k}" if self.m == 1 else f"parity:{self.k}+{self.m}"

    def extra_memory(self) -> float:
        """Extra host memory per node, as a fraction of its tier."""
        return {"pair": 1.0, "parity": self.m / self.k if self.k else 0.0}.get(self.kind, 0.0)


def parse_scheme(value: Any) -> Scheme:
    """``value`` (``"none"``, ``"pair"``, ``"replicas"``, ``"parity:k"``,
    ``"parity:k+m"``) as a :class:`Scheme`; ConfigError naming the choices
    otherwise. ``parity:k+1`` is ``parity:k`` (XOR).

    >>> parse_scheme("parity:4")
    Scheme(kind='parity', k=4, m=1)
    >>> str(parse_scheme("parity:2+2")), str(parse_scheme("parity:3+1"))
    ('parity:2+2', 'parity:3')
    >>> parse_scheme("raid6")
    Traceback (most recent call last):
    ...
    dstt.errors.ConfigError: redundancy must be one of none, pair, replicas, parity:k, parity:k+m (1 <= k <= 64; 2 <= m <= 8, k + m <= 32), got 'raid6'
    """
    if isinstance(value, str):
        if value in ("none", "pair", "replicas"):
            return Scheme(value)
        m = re.fullmatch(r"parity:([0-9]{1,3})(?:\+([0-9]{1,3}))?", value)
        if m:
            k, p = int(m.group(1)), int(m.group(2) or 1)
            if 1 <= k <= MAX_K and (p == 1 or (2 <= p <= MAX_M and k + p <= MAX_RS_GROUP)):
                return Scheme("parity", k, p)
    raise ConfigError(f"redundancy must be one of {', '.join(SCHEMES)} (1 <= k <= {MAX_K}; 2 <= m <= {MAX_M}, "
                      f"k + m <= {MAX_RS_GROUP}), got {value!r}"[:300])


# ----------------------------------------------------------------------------- placement


def partner(node: int, nodes: int) -> int:
    """The node holding ``node``'s copies under ``pair``: the next one on a
    ring of ``nodes`` (never itself: ConfigError for fewer than 2 nodes)."""
    if nodes < 2 or not 0 <= node < nodes:
        raise ConfigError(f"redundancy='pair' needs at least 2 nodes (node {node} of {nodes})")
    return (node + 1) % nodes


def holders_of(node: int, nodes: int) -> int:
    """The node whose copies ``node`` holds under ``pair`` (the inverse of :func:`partner`)."""
    return (node - 1) % nodes


def parity_groups(nodes: int, k: int, m: int = 1) -> list[list[int]]:
    """Groups of ``k + m`` consecutive nodes; a remainder of ``m`` nodes or
    fewer (too few to hold ``m`` parities of anything) joins the last group,
    a larger remainder is a smaller group of its own (fewer pieces per
    parity there: more memory, the same protection).

    >>> parity_groups(9, 2, 2), parity_groups(7, 2, 2)
    ([[0, 1, 2, 3], [4, 5, 6, 7, 8]], [[0, 1, 2, 3], [4, 5, 6]])
    """
    if k < 1 or m < 1 or nodes < 2:
        raise ConfigError(f"redundancy='parity:{k}' needs k >= 1 and at least 2 nodes (got {nodes})")
    g = k + m
    groups = [list(range(i, min(i + g, nodes))) for i in range(0, nodes, g)]
    if len(groups) > 1 and len(groups[-1]) <= m:
        groups[-2].extend(groups.pop())
    return groups


def group_of(node: int, nodes: int, k: int, m: int = 1) -> list[int]:
    return next(g for g in parity_groups(nodes, k, m) if node in g)


def node_ids(hosts: list[str]) -> list[int]:
    """Each rank's node number from the host names (or DSTT_NODE_ID values)
    of ranks 0..W-1: nodes numbered in order of their first rank."""
    order: dict[str, int] = {}
    return [order.setdefault(h, len(order)) for h in hosts]


# ----------------------------------------------------------------------------- XOR parity


def _stripes(block: bytes, pieces: int) -> list[bytes]:
    size = -(-len(block) // pieces) if block else 0
    return [block[i * size:(i + 1) * size] for i in range(pieces)]


def _stripe_index(member: int, holder: int) -> int:
    """Which of ``member``'s pieces goes into ``holder``'s parity."""
    return holder if holder < member else holder - 1


def xor_into(acc: np.ndarray, data: bytes) -> np.ndarray:
    """``acc`` XOR ``data`` (zero-padded to the longer), a new array if it grows."""
    d = np.frombuffer(data, dtype=np.uint8)
    if d.size > acc.size:
        acc = np.concatenate([acc, np.zeros(d.size - acc.size, np.uint8)])
    np.bitwise_xor(acc[:d.size], d, out=acc[:d.size])
    return acc


def stripe_for(block: bytes, member: int, holder: int, group_size: int) -> bytes:
    """The piece of ``member``'s ``block`` that goes into ``holder``'s parity."""
    return _stripes(block, group_size - 1)[_stripe_index(member, holder)]


def encode_parity(blocks: list[bytes], holder: int) -> bytes:
    """The parity block member ``holder`` (an index into ``blocks``, one per
    group member) keeps: the XOR of the other members' pieces for it."""
    g = len(blocks)
    acc = np.zeros(0, np.uint8)
    for m, b in enumerate(blocks):
        if m != holder:
            acc = xor_into(acc, stripe_for(b, m, holder, g))
    return acc.tobytes()


def rebuild(lost: int, length: int, blocks: dict[int, bytes], parities: dict[int, bytes], group_size: int) -> bytes:
    """Member ``lost``'s block (``length`` bytes) from the other members'
    blocks and the parity blocks they hold; BlockError if one is missing."""
    pieces = group_size - 1
    size = -(-length // pieces) if length else 0
    out = bytearray()
    for holder in range(group_size):
        if holder == lost:
            continue
        if holder not in parities or any(m not in blocks for m in range(group_size) if m not in (lost, holder)):
            raise BlockError(f"member {lost} cannot be rebuilt: member {holder}'s parity or a block is missing")
        acc = xor_into(np.zeros(0, np.uint8), parities[holder])
        for m in range(group_size):
            if m not in (lost, holder):
                acc = xor_into(acc, stripe_for(blocks[m], m, holder, group_size))
        idx = _stripe_index(lost, holder)
        want = max(0, min(size, length - idx * size))
        out += acc.tobytes()[:want].ljust(want, b"\0")
    return bytes(out[:length])


# ----------------------------------------------------------------------------- framing


@dataclass(frozen=True)
class BlockHead:
    """What a block says it is."""

    run: str
    branch_id: int
    step: int
    rank: int
    kind: str
    length: int
    crc: int
    meta: dict[str, Any]


def frame(payload: bytes, *, run: str, branch_id: int, step: int, rank: int, kind: str = "copy",
          meta: dict[str, Any] | None = None) -> bytes:
    """``payload`` with its header (see the module docstring)."""
    if kind not in KINDS or not _RUN_RE.fullmatch(run):
        raise ConfigError(f"block kind {kind!r} / run {run!r}")
    head = json.dumps({"run": run, "branch_id": branch_id, "step": step, "rank": rank, "kind": kind,
                       "length": len(payload), "crc": crc32c(payload), "meta": meta or {}},
                      separators=(",", ":")).encode()
    return _HEAD.pack(MAGIC, len(head), crc32c(head)) + head + payload


def read_head(data: bytes | memoryview) -> tuple[BlockHead, int]:
    """The header of a framed block and where its payload starts; BlockError if torn or corrupted."""
    mv = memoryview(data)
    if len(mv) < _HEAD.size:
        raise BlockError(f"block torn: {len(mv)} bytes")
    magic, n, crc = _HEAD.unpack(mv[:_HEAD.size])
    if magic != MAGIC or n > MAX_HEADER_BYTES or len(mv) < _HEAD.size + n:
        raise BlockError("not a dstt redundancy block, or its header is torn")
    raw = bytes(mv[_HEAD.size:_HEAD.size + n])
    if crc32c(raw) != crc:
        raise BlockError("block header fails its CRC-32C")
    try:
        d = json.loads(raw)
        head = BlockHead(d["run"], d["branch_id"], d["step"], d["rank"], d["kind"], d["length"], d["crc"],
                         d["meta"])
    except (ValueError, KeyError, TypeError) as e:
        raise BlockError(f"block header unreadable: {e}") from None
    ints = (head.step, head.rank, head.length, head.crc, head.branch_id)
    if not (all(type(x) is int and x >= 0 for x in ints) and head.kind in KINDS and isinstance(head.meta, dict)):
        raise BlockError("block header fields out of range")
    return head, _HEAD.size + n


def unframe(data: bytes | memoryview, *, run: str, branch_id: int, step: int, rank: int | None = None,
            kind: str = "copy") -> tuple[BlockHead, bytes]:
    """The header and payload of ``data`` if it is whole and the block
    expected (``run``, ``branch_id``, ``step``, ``rank``, ``kind``); else
    BlockError naming what is off (a stale block is never used)."""
    head, start = read_head(data)
    want = {"run": run, "branch_id": branch_id, "step": step, "kind": kind, **({"rank": rank} if rank is not None
                                                                              else {})}
    off = [f"{k} {getattr(head, k)!r} (expected {v!r})" for k, v in want.items() if getattr(head, k) != v]
    if off:
        raise BlockError(f"stale block: {', '.join(off)}")
    payload = bytes(memoryview(data)[start:])
    if len(payload) != head.length:
        raise BlockError(f"block torn: {len(payload)} of {head.length} payload bytes")
    if crc32c(payload) != head.crc:
        raise BlockError(f"block of step {step} fails its CRC-32C")
    return head, payload


# ----------------------------------------------------------------------------- protection records

PROTECT_DIR = f"{L.META}/redundancy"
PROTECT_FORMAT = "dstt-redundancy-protected"
MAX_RECORD_BYTES = 1 << 20
MAX_RANGES = 4096


@dataclass(frozen=True)
class Protected:
    """Steps of one rank whose copies (or parity) are complete and acknowledged."""

    branch: str
    run: str
    rank: int
    world: int
    node: int
    scheme: str
    steps: tuple[tuple[int, int], ...]


def protect_key(branch: str, rank: int) -> str:
    return f"{PROTECT_DIR}/{L.validate_branch(branch)}/rank-{rank:05d}.json"


def write_protected(backend: Any, rec: Protected) -> None:
    """Publish (overwrite) ``rec``."""
    if not (0 <= rec.rank < rec.world) or not _RUN_RE.fullmatch(rec.run):
        raise ConfigError(f"protection record of rank {rec.rank} of {rec.world}, run {rec.run!r}")
    backend.put_atomic(protect_key(rec.branch, rec.rank), encode_json({
        "format": PROTECT_FORMAT, "format_version": 1, "branch": rec.branch, "run": rec.run, "rank": rec.rank,
        "world": rec.world, "node": rec.node, "scheme": rec.scheme,
        "steps": [[a, b] for a, b in rec.steps][-MAX_RANGES:]}))


def _parse(data: bytes, where: str, branch: str) -> Protected:
    doc = decode_json(data, where)
    ok = isinstance(doc, dict) and doc.get("format") == PROTECT_FORMAT and doc.get("format_version") == 1 \
        and doc.get("branch") == branch
    r, w, n = (doc.get(x) if isinstance(doc, dict) else None for x in ("rank", "world", "node"))
    ok = ok and all(type(x) is int for x in (r, w, n)) and 0 <= r < w and 0 <= n < w  # type: ignore[operator]
    ok = ok and isinstance(doc.get("run"), str) and bool(_RUN_RE.fullmatch(doc["run"]))
    steps = doc.get("steps") if ok else None
    ok = ok and isinstance(steps, list) and len(steps) <= MAX_RANGES and isinstance(doc.get("scheme"), str)
    out: list[tuple[int, int]] = []
    prev = -1
    for s in steps if ok else []:  # type: ignore[union-attr]
        if not (isinstance(s, list) and len(s) == 2 and all(type(x) is int for x in s) and prev < s[0] <= s[1]
                <= L.MAX_STEP):
            ok = False
            break
        out.append((s[0], s[1]))
        prev = s[1]
    if not ok:
        raise CorruptStoreError(f"{where}: not a valid protection record")
    return Protected(branch, doc["run"], r, w, n, doc["scheme"][:32], tuple(out))  # type: ignore[arg-type]


def read_protected(backend: Any, branch: str) -> list[Protected]:
    """Every rank's protection record of ``branch`` (a bad one skipped with a warning)."""
    prefix = f"{PROTECT_DIR}/{L.validate_branch(branch)}/"
    records: list[Protected] = read_rank_records(backend, prefix, lambda data, key: _parse(data, key, branch),
                                                 "protection")
    return records


def protected_steps(records: list[Protected]) -> tuple[str, list[tuple[int, int]]]:
    """(scheme, step ranges protected on every rank) of rank 0's run: a
    step counts only if every rank of the world protected it."""
    first = next((r for r in records if r.rank == 0), None)
    if first is None:
        return "none", []
    latest = [r for r in records if r.run == first.run and r.world == first.world]
    if len({r.rank for r in latest}) < first.world:
        return first.scheme, []
    common = list(first.steps)
    for r in latest[1:]:
        common = _intersect(common, list(r.steps))
    return first.scheme, common


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


__all__ = ["BlockError", "BlockHead", "KINDS", "MAGIC", "Protected", "SCHEMES", "Scheme", "encode_parity",
           "frame", "group_of", "holders_of", "node_ids", "parity_groups", "parse_scheme", "partner",
           "protected_steps", "read_head", "read_protected", "rebuild", "stripe_for", "unframe",
           "write_protected", "xor_into"]
