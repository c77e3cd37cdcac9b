"""The staging ring in /dev/shm: pool files and sealed step records that
outlive the trainer.

Layout (one directory per Capture, mode 0700, under the user's own root)::

    /dev/shm/dstt-<uid>/<group>/<run>/owner.json        who, for which store and branch
                                     /pool-<gen>.bin    the staging pool (mmap'ed)
                                     /seal-<step>.json  one sealed step

``<group>`` hashes the store's URL and the branch; ``owner.json`` also names
the branch id and its creation time, so a ring is never applied to another
store or to a branch recreated under the same name.

A step is *sealed* once every copy of it has landed in the pool: its record
(step, the plan's layouts and value tree, and per chunk its place in the
pool file and the CRC-32C of the bytes there) is written with an atomic
rename. The pool blocks of a sealed step are not reused until the step is
committed; then the record is removed. So if the trainer dies, each record
left names bytes that are still in the pool file, and the next Capture on
that store and branch (which holds the branch lock, so no other writer
owns those rings) commits them in step order (:func:`recover`), checking
every CRC first; a ring that does not check out is discarded whole.

Why files and not ``multiprocessing.shared_memory``: its resource tracker
unlinks segments when the process that made them exits, which is exactly
the moment they are needed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import torch

from dstt.errors import CaptureError
from dstt.store.codec import CodecSpec, crc32c
from dstt.store.dtypes import info_for_name
from dstt.store.localio import pid_alive
from dstt.store.packs import default_pack_chunk_bytes
from dstt.store.plan import ChunkTask, StepPlan, TensorLayout
from dstt.store.shards import Region

log = logging.getLogger("dstt.capture")

SHM_ROOT = Path("/dev/shm")
SEAL_FORMAT = "dstt-ring-seal"
#: A seal record is a few KB per hundred tensors; anything bigger is not ours.
SEAL_MAX_BYTES = 256 << 20


def ring_root(base: Path | None = None) -> Path:
    return (base or SHM_ROOT) / f"dstt-{os.getuid()}"


def shm_free_bytes(base: Path | None = None) -> int | None:
    """Free bytes of /dev/shm, or None where there is none."""
    base = base or SHM_ROOT
    try:
        st = os.statvfs(base)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def group_dir(store_url: str, branch: str, base: Path | None = None, rank: int | None = None) -> Path:
    """The directory of the rings of a store's branch (of one rank of a
    distributed Capture: each rank's rings apart, so one rank's recovery
    never judges another rank's ring)."""
    text = f"{store_url}\0{branch}" + ("" if rank is None else f"\0rank{rank}")
    return ring_root(base) / hashlib.sha256(text.encode()).hexdigest()[:24]


def group_of(identity: dict[str, Any], base: Path | None = None) -> Path:
    return group_dir(identity["store"], identity["branch"], base, identity.get("rank"))


def _private_dir(path: Path) -> None:
    """Create ``path`` (and parents) as 0700 and check it is ours: a ring
    read back is trusted only if nobody else could have written it."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not path.is_dir() or path.is_symlink() or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise CaptureError(f"{path}: not a private directory of this user; refusing to stage there")


class Ring:
    """This Capture's ring directory: pool files and seal records.

    >>> import tempfile
    >>> r = Ring({"store": "s", "branch": "main", "branch_id": 0, "branch_created": 0.0},
    ...          base=Path(tempfile.mkdtemp()))
    >>> buf = r.new_pool(1 << 16)
    >>> buf.numel(), r.pool_name
    (65536, 'pool-0.bin')
    >>> r.close()
    """

    def __init__(self, identity: dict[str, Any], base: Path | None = None, run: str | None = None) -> None:
        self.identity = dict(identity)
        self.group = group_of(identity, base)
        _private_dir(ring_root(base))
        sweep(base)
        _private_dir(self.group)
        self.dir = self.group / f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        _private_dir(self.dir)
        # ``run`` (a distributed Capture's id, ranks.py) is not identity: a
        # ring of an earlier run of the same store and branch is recovered.
        owner = {**self.identity, "pid": os.getpid(), **({"run": run} if run else {})}
        _write_atomic(self.dir / "owner.json", json.dumps(owner).encode())
        self._gen = -1
        self.pool_name = ""
        self._maps: dict[str, mmap.mmap] = {}

    def new_pool(self, capacity_bytes: int) -> torch.Tensor:
        """A fresh pool file of ``capacity_bytes`` mapped shared; its pages
        are not touched here (the first copies fault them in)."""
        self._gen += 1
        name = f"pool-{self._gen}.bin"
        fd = os.open(self.dir / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, capacity_bytes)
            mm = mmap.mmap(fd, capacity_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._maps[name] = mm
        self.pool_name = name
        return torch.frombuffer(mm, dtype=torch.uint8)

    def drop_pool(self, name: str) -> None:
        """Forget an old pool file (no sealed step refers to it any more)."""
        self._maps.pop(name, None)  # the mapping goes when its last tensor view does
        with _suppress():
            os.unlink(self.dir / name)

    def seal(self, record: dict[str, Any]) -> None:
        _write_atomic(self.dir / f"seal-{record['step']:020d}.json", encode_record(record))

    def unseal(self, step: int) -> None:
        unseal_file(self.dir, step)

    def close(self) -> None:
        """Remove the ring (everything in it is committed or given up)."""
        self._maps.clear()
        remove_ring(self.dir)


def sweep(base: Path | None = None) -> int:
    """Remove rings that can never be committed, of any store: their owner
    is dead and they hold no seal record, or the local store they belong to
    is gone. (A ring with seals of a live store waits for the next Capture
    on its branch.) The number removed."""
    removed = 0
    try:
        groups = list(ring_root(base).iterdir())
    except OSError:
        return 0
    for group in groups:
        for ring in list(group.iterdir()) if group.is_dir() and not group.is_symlink() else []:
            try:
                owner = json.loads(read_bounded(ring / "owner.json"))
                pid, store = int(owner["pid"]), str(owner["store"])
            except (OSError, ValueError, KeyError, TypeError, CorruptRing):
                continue  # being created, or not ours to judge
            if pid_alive(pid):
                continue
            local_gone = store.startswith("/") and not os.path.exists(store)
            if local_gone or not any(ring.glob("seal-*.json")):
                remove_ring(ring)
                removed += 1
        with _suppress():
            group.rmdir()  # empty: every ring of that store and branch is gone
    return removed



def unseal_file(ring: Path, step: int) -> None:
    with _suppress():
        os.unlink(ring / f"seal-{step:020d}.json")


def sealed_steps(ring: Path) -> list[int]:
    """Steps with a seal record in ``ring``, in order."""
    out = []
    for p in ring.glob("seal-*.json"):
        digits = p.name[5:-5]
        if digits.isdigit():
            out.append(int(digits))
    return sorted(out)


def remove_ring(ring: Path) -> None:
    shutil.rmtree(ring, ignore_errors=True)
    with _suppress():
        ring.parent.rmdir()  # when no other ring of this store and branch is left


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], OSError)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- records


def seal_record(plan: StepPlan, pool_name: str, pool: torch.Tensor, staged: list[tuple[ChunkTask, torch.Tensor]],
                crc: bool = True) -> dict[str, Any]:
    """The record of a step whose chunks are all in ``pool`` (``staged``:
    each task with its pool view). ``crc=False``: no CRC per chunk (a pass
    over the step) -- for a writer that removes a step's seal before its
    memory is reused (the flight recorder's slots), so a seal never
    outlives its bytes; recovery then commits the chunks as they are.

    Format 2 (what :func:`encode_record` writes and :func:`read_record`
    reads): what changes from step to step -- each chunk's place in the pool
    and CRC, in the order of ``static["tasks"]`` -- apart from what stays
    the same while the state's layout does (the layouts, the meta arrays and
    each task's chunk; ``static``, one object reused step after step) and
    the value tree. A fast loop seals a step every few milliseconds: the
    unchanged parts are encoded once by the trainer and decoded once by the
    capture helper (issue 16)."""
    static = _static_of(plan)
    base = pool.data_ptr()
    whole = pool.numpy()  # (one array of the pool: a slice of it per chunk, no tensor per chunk)
    views = {id(t): v for t, v in staged}
    if len(views) != len(plan.tasks):
        raise CaptureError(f"step {plan.step}: {len(views)} chunks staged for {len(plan.tasks)} planned")
    starts, sizes, crcs = [], [], []
    extend = google_crc32c.extend
    for t in plan.tasks:
        v = views[id(t)]
        start, nbytes = v.data_ptr() - base, v.nbytes
        starts.append(start)
        sizes.append(nbytes)
        if crc:
            crcs.append(extend(0, whole[start:start + nbytes]))
    return {"format": SEAL_FORMAT, "version": 2, "step": plan.step, "seq": plan.seq, "pool": pool_name,
            "tree": plan.tree, "layouts": static["layouts"], "meta": static["meta"],
            "tasks": {"static": static["tasks"], "start": starts, "nbytes": sizes, "crc": crcs if crc else None},
            "_static": static}


#: The static part of the last sealed plans (see seal_record), keyed by the
#: identity of their layouts (a layout is never changed once built, and
#: the key's layouts are kept alive here, so their ids are not reused).
_STATIC: dict[tuple[int, ...], tuple[list[TensorLayout], list[tuple[TensorLayout, int]], dict[str, Any]]] = {}
_STATIC_MAX = 8
#: (tasks, layouts, meta_arrays, static) of the last plan sealed: its lists
#: are kept alive, so a later plan holding the very same lists is that plan's layout.
_LAST_STATIC: tuple[list[ChunkTask], list[TensorLayout], list[TensorLayout], dict[str, Any]] | None = None


def _static_of(plan: StepPlan) -> dict[str, Any]:
    """The unchanging part of ``plan``'s seal record: the same object for
    plans with the same layouts and tasks (a capture's steps, as long as its
    state keeps its layout)."""
    global _LAST_STATIC
    last = _LAST_STATIC
    if last is not None and last[0] is plan.tasks and last[1] is plan.layouts and last[2] is plan.meta_arrays:
        return last[3]  # a plan reused whole (plan._StepMemo): the same lists, never changed
    key = tuple(map(id, plan.layouts)) + (-1,) + tuple(map(id, plan.meta_arrays))
    got = _STATIC.get(key)
    if got is not None and len(got[1]) == len(plan.tasks) and all(
            t.layout is l and t.index == i for t, (l, i) in zip(plan.tasks, got[1])):
        _LAST_STATIC = (plan.tasks, plan.layouts, plan.meta_arrays, got[2])
        return got[2]
    index = {id(l): i for i, l in enumerate(plan.layouts)}
    static = {
        "layouts": [_layout_doc(l) for l in plan.layouts],
        "meta": [index[id(l)] for l in plan.meta_arrays],
        "tasks": [[index[id(t.layout)], t.index, list(t.coords), list(t.offset), list(t.shape),
                   _dtype_name(t.source.dtype)] for t in plan.tasks],
    }
    if len(_STATIC) >= _STATIC_MAX:
        _STATIC.clear()
    _STATIC[key] = (list(plan.layouts) + list(plan.meta_arrays), [(t.layout, t.index) for t in plan.tasks], static)
    _LAST_STATIC = (plan.tasks, plan.layouts, plan.meta_arrays, static)
    return static


#: Layout documents and layouts rebuilt from them, memoized: a capture
#: seals the same layouts step after step (tens of thousands of tensors:
#: issue 16). Keyed by the layout object (kept alive with its document, so
#: its id is not reused) and by the document's content; cleared when full.
_DOCS: dict[int, tuple[TensorLayout, dict[str, Any]]] = {}
_LAYOUTS: dict[Any, TensorLayout] = {}
_MEMO_MAX = 1 << 17


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


class _TextCache:
    """The JSON text of the last few objects encoded (by identity, kept
    alive: equality would not do, ``1 == 1.0 == True`` encode differently)
    and the objects the last few texts decoded to: what repeats from one
    seal record to the next is encoded and decoded once."""

    def __init__(self) -> None:
        self.texts: list[tuple[Any, str]] = []  # (object, its JSON), newest last
        self.parsed: list[tuple[bytes, Any]] = []  # (JSON bytes, the object), newest last

    def encode(self, obj: Any) -> str:
        for o, text in self.texts:
            if o is obj:
                return text
        text = json.dumps(obj, allow_nan=False)
        self.texts = [*self.texts[-3:], (obj, text)]
        return text

    def decode(self, data: bytes) -> Any:
        for raw, obj in self.parsed:
            if raw == data:
                return obj
        obj = json.loads(data)
        self.parsed = [*self.parsed[-3:], (bytes(data), obj)]
        return obj


_TREES = _TextCache()
_STATICS = _TextCache()
_SEP_TREE = b', "tree": '
_SEP_STATIC = b', "static": '


def encode_record(record: dict[str, Any]) -> bytes:
    """``record`` (from :func:`seal_record`) as one JSON document: first what
    changes every step, then the tree and the static part, whose texts are
    reused from earlier records while they are unchanged. :func:`read_record`
    reads it back (any JSON parser reads it too)."""
    if record.get("version") != 2:  # (a record of the first format: written as it is)
        return json.dumps({k: v for k, v in record.items() if not k.startswith("_")}, allow_nan=False).encode()
    static = record.get("_static")
    if static is None:
        static = {"layouts": record["layouts"], "meta": record["meta"], "tasks": record["tasks"]["static"]}
    tasks = record["tasks"]
    tree_text = _TREES.encode(record["tree"])
    static_text = _STATICS.encode(static)
    head = {"format": SEAL_FORMAT, "version": 2, "step": record["step"], "seq": record["seq"],
            "pool": record["pool"], "start": tasks["start"], "nbytes": tasks["nbytes"], "crc": tasks["crc"],
            "tree_bytes": len(tree_text.encode()), "static_bytes": len(static_text.encode())}
    return b"".join([json.dumps(head, allow_nan=False)[:-1].encode(), _SEP_TREE, tree_text.encode(),
                     _SEP_STATIC, static_text.encode(), b"}"])


def read_record(data: bytes) -> dict[str, Any]:
    """A seal record (any format) from its bytes, as :func:`seal_record`
    made it: ``step``, ``seq``, ``pool``, ``tree``, ``layouts``, ``meta``
    and ``tasks`` (a list of dicts in the first format). Parts unchanged
    since the last records read are not decoded again (read-only objects,
    shared). ValueError (or CorruptRing) if it is not one."""
    fast = _read_v2(data)
    if fast is not None:
        return fast
    doc = json.loads(data)
    if not isinstance(doc, dict) or doc.get("format") != SEAL_FORMAT:
        raise CorruptRing("not a seal record")
    if doc.get("version") == 2:
        static = doc["static"]
        if not isinstance(static, dict):
            raise CorruptRing("bad static part")
        doc = {**doc, "layouts": static["layouts"], "meta": static["meta"],
               "tasks": {"static": static["tasks"], "start": doc["start"], "nbytes": doc["nbytes"],
                         "crc": doc["crc"]}}
    return doc


def _read_v2(data: bytes) -> dict[str, Any] | None:
    """The fast path of :func:`read_record` for a record encode_record wrote;
    None for anything else (read the slow way)."""
    i = data.find(_SEP_TREE)
    if i < 0:
        return None
    try:
        head = json.loads(data[:i] + b"}")
    except ValueError:
        return None
    if not isinstance(head, dict) or head.get("format") != SEAL_FORMAT or head.get("version") != 2:
        return None
    nt, ns = head.get("tree_bytes"), head.get("static_bytes")
    if not isinstance(nt, int) or not isinstance(ns, int) or nt < 0 or ns < 0:
        return None
    a = i + len(_SEP_TREE)
    b = a + nt
    c = b + len(_SEP_STATIC)
    if data[b:c] != _SEP_STATIC or c + ns + 1 != len(data) or data[-1:] != b"}":
        return None
    tree = _TREES.decode(data[a:b])
    static = _STATICS.decode(data[c:c + ns])
    if not isinstance(static, dict):
        raise CorruptRing("bad static part")
    head["tree"] = tree
    head["layouts"], head["meta"] = static["layouts"], static["meta"]
    head["tasks"] = {"static": static["tasks"], "start": head.pop("start"), "nbytes": head.pop("nbytes"),
                     "crc": head.pop("crc")}
    return head


def _layout_doc(l: TensorLayout) -> dict[str, Any]:
    got = _DOCS.get(id(l))
    if got is not None and got[0] is l:
        return got[1]
    doc = _make_layout_doc(l)
    if len(_DOCS) >= _MEMO_MAX:
        _DOCS.clear()
    _DOCS[id(l)] = (l, doc)
    return doc


def _make_layout_doc(l: TensorLayout) -> dict[str, Any]:
    return {"name": l.name, "kind": l.kind, "dtype": l.dtype.logical, "shape": list(l.shape),
            "chunk_shape": list(l.chunk_shape), "compression": l.codec.compression, "level": l.codec.level,
            "regions": [[list(r.offset), list(r.shape), list(r.holders)] for r in l.regions],
            "pack_chunk_bytes": l.pack_chunk_bytes}


def _layout_of(d: dict[str, Any]) -> TensorLayout:
    """The layout a document describes; the same object for the same
    content (a layout is never changed once built)."""
    packing = d.get("pack_chunk_bytes")
    key = (d["name"], d["kind"], d["dtype"], tuple(d["shape"]), tuple(d["chunk_shape"]), d["compression"],
           d["level"], packing if isinstance(packing, int) else ("env", default_pack_chunk_bytes()),
           tuple((tuple(o), tuple(s), tuple(h)) for o, s, h in d["regions"]))
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _make_layout(d)
        if len(_LAYOUTS) >= _MEMO_MAX:
            _LAYOUTS.clear()
        _LAYOUTS[key] = layout
    return layout


def _make_layout(d: dict[str, Any]) -> TensorLayout:
    packing = d.get("pack_chunk_bytes")  # packed as the trainer planned it (packs.py)
    extra: dict[str, Any] = {"pack_chunk_bytes": packing} if isinstance(packing, int) else {}
    return TensorLayout(d["name"], d["kind"], info_for_name(d["dtype"]), tuple(d["shape"]),
                        tuple(d["chunk_shape"]), CodecSpec(d["compression"], d["level"]),
                        [Region(tuple(o), tuple(s), list(h)) for o, s, h in d["regions"]], **extra)


#: Layouts and task templates of the last static parts replayed (plan_of),
#: by the identity of the static part's task list (kept alive here).
_REPLAYED: list[tuple[list[Any], list[TensorLayout], list[tuple[TensorLayout, int, tuple[int, ...], tuple[int, ...],
                                                               tuple[int, ...], torch.dtype]]]] = []


def _templates(layout_docs: list[dict[str, Any]], static_tasks: list[Any]
               ) -> tuple[list[TensorLayout], list[tuple[TensorLayout, int, tuple[int, ...], tuple[int, ...],
                                                         tuple[int, ...], torch.dtype]]]:
    global _REPLAYED
    for tasks, layouts, templates in _REPLAYED:
        if tasks is static_tasks:
            return layouts, templates
    layouts = [_layout_of(d) for d in layout_docs]
    templates = []
    for li, index, coords, offset, shape, dtype_name in static_tasks:
        dtype = getattr(torch, dtype_name)
        if not isinstance(dtype, torch.dtype):
            raise CorruptRing(f"unknown dtype {dtype_name!r}")
        templates.append((layouts[li], int(index), tuple(coords), tuple(offset), tuple(shape), dtype))
    _REPLAYED = [*_REPLAYED[-3:], (static_tasks, layouts, templates)]
    return layouts, templates


def plan_of(record: dict[str, Any], pool: torch.Tensor, verify: bool = True) -> StepPlan:
    """Rebuild a sealed step's plan, its tasks' sources viewing ``pool``;
    with ``verify``, CorruptRing if a chunk's bytes no longer match their CRC
    (a ring left by a dead trainer; the live trainer's helper trusts it)."""
    tasks_doc = record["tasks"]
    if isinstance(tasks_doc, list):  # the first format: one dict per task
        return _plan_of_v1(record, pool, verify)
    layouts, templates = _templates(record["layouts"], tasks_doc["static"])
    starts, sizes, crcs = tasks_doc["start"], tasks_doc["nbytes"], tasks_doc["crc"]
    if not len(starts) == len(sizes) == len(templates) or (crcs is not None and len(crcs) != len(starts)):
        raise CorruptRing("chunk table lengths differ")
    size = pool.numel()
    tasks = []
    narrow = pool.narrow
    for j, (layout, index, coords, offset, shape, dtype) in enumerate(templates):
        start, nbytes = starts[j], sizes[j]
        if not (isinstance(start, int) and isinstance(nbytes, int) and 0 <= start <= start + nbytes <= size):
            raise CorruptRing(f"chunk at {start}+{nbytes} outside the pool")
        block = narrow(0, start, nbytes)
        if verify and crcs is not None and crc32c(np.frombuffer(block.numpy(), np.uint8)) != crcs[j]:
            raise StaleSeal(f"step {record['step']}: a chunk of {layout.name} does not match its CRC")
        source = block.view(dtype)
        if len(shape) != 1:
            source = source.view(shape)
        tasks.append(ChunkTask(layout, index, coords, offset, shape, source))
    return StepPlan(int(record["step"]), record["tree"], layouts, tasks, [layouts[i] for i in record["meta"]])


def _plan_of_v1(record: dict[str, Any], pool: torch.Tensor, verify: bool) -> StepPlan:
    layouts = [_layout_of(d) for d in record["layouts"]]
    tasks = []
    for d in record["tasks"]:
        start, nbytes = int(d["start"]), int(d["nbytes"])
        if not 0 <= start <= start + nbytes <= pool.numel():
            raise CorruptRing(f"chunk at {start}+{nbytes} outside the pool")
        block = pool[start:start + nbytes]
        if verify and d["crc"] is not None and crc32c(np.frombuffer(block.numpy(), np.uint8)) != d["crc"]:
            raise StaleSeal(f"step {record['step']}: a chunk of {layouts[d['layout']].name} does not match its CRC")
        dtype = getattr(torch, d["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise CorruptRing(f"unknown dtype {d['dtype']!r}")
        source = block.view(dtype).view(tuple(d["shape"]))
        tasks.append(ChunkTask(layouts[d["layout"]], int(d["index"]), tuple(d["coords"]), tuple(d["offset"]),
                               tuple(d["shape"]), source))
    return StepPlan(int(record["step"]), record["tree"], layouts, tasks, [layouts[i] for i in record["meta"]])


class CorruptRing(Exception):
    """A ring left behind does not check out: it is discarded, never committed."""


class StaleSeal(CorruptRing):
    """One sealed step's bytes changed since it was sealed (its blocks were
    reused after its commit failed): that step is skipped, never committed."""


# ----------------------------------------------------------------------------- recovery


def abandoned(identity: dict[str, Any], base: Path | None = None, exclude: Path | None = None
              ) -> list[tuple[Path, list[dict[str, Any]]]]:
    """Rings of this store and branch other than ``exclude``, each with its
    seal records in step order. Rings of another store or of an earlier
    branch of the same name are removed. The caller holds the branch lock,
    so every other ring's owner is gone (or closed)."""
    group = group_of(identity, base)
    out = []
    try:
        entries = sorted(group.iterdir())
    except OSError:
        return []
    for ring in entries:
        if ring == exclude or not ring.is_dir() or ring.is_symlink():
            continue
        try:
            if os.lstat(ring).st_uid != os.getuid():
                continue
            owner = json.loads(read_bounded(ring / "owner.json"))
            if not isinstance(owner, dict) or any(owner.get(k) != v for k, v in identity.items()):
                raise CorruptRing("another store or branch")
            seals = []
            for p in sorted(ring.glob("seal-*.json")):
                try:
                    doc = read_record(read_bounded(p))
                except CorruptRing as e:
                    raise CorruptRing(f"{p.name}: {e}") from None
                seals.append(doc)
        except (OSError, ValueError, CorruptRing) as e:
            log.warning("dstt: discarding staging ring %s: %s", ring, e)
            shutil.rmtree(ring, ignore_errors=True)
            continue
        out.append((ring, sorted(seals, key=lambda d: d["step"])))
    return out


def map_pool(ring: Path, name: str) -> torch.Tensor:
    if "/" in name or not name.startswith("pool-"):
        raise CorruptRing(f"bad pool name {name!r}")
    fd = os.open(ring / name, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE) if size else None
    finally:
        os.close(fd)
    if mm is None:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mm, dtype=torch.uint8)


def read_bounded(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        import stat

        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptRing(f"{path.name}: not a regular file")
        chunks, size = [], 0
        while size <= SEAL_MAX_BYTES:
            part = os.read(fd, SEAL_MAX_BYTES + 1 - size)
            if not part:
                break
            chunks.append(part)
            size += len(part)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > SEAL_MAX_BYTES:
        raise CorruptRing(f"{path.name}: larger than {SEAL_MAX_BYTES} bytes")
    return data


def recover(writer: Any, identity: dict[str, Any], *, exclude: Path | None = None, base: Path | None = None
            ) -> list[int]:
    """Commit, in step order, the sealed steps of this branch's abandoned
    rings that are newer than its last commit; remove those rings. The
    steps committed. ``writer`` (a :class:`~dstt.store.writer.Writer` of a
    single process) holds the branch lock."""
    done: list[int] = []
    for ring, seals in abandoned(identity, base, exclude):
        maps: dict[str, torch.Tensor] = {}
        try:
            for record in seals:
                step = record.get("step")
                if not isinstance(step, int) or (writer.last_step is not None and step <= writer.last_step and (
                        step == writer.last_step or writer.is_stored(step))):
                    continue  # committed before the trainer died (an older one not stored is a backfill: Writer.adopt)
                pool = maps.get(record["pool"])
                if pool is None:
                    pool = maps[record["pool"]] = map_pool(ring, record["pool"])
                try:
                    plan = writer.adopt(plan_of(record, pool))
                except StaleSeal as e:
                    log.warning("dstt: not committing a step of staging ring %s: %s", ring, e)
                    continue
                writer.ensure_arrays(plan)
                results, error = writer.flush_chunks(plan, plan.tasks)  # (store/batchflush.py)
                if error is not None:
                    raise error
                writer.commit(plan, results)
                done.append(step)
                log.warning("dstt: committed step %d of branch %r, sealed in the staging ring of a trainer that "
                            "died (%s)", step, identity["branch"], ring.name)
        except (CorruptRing, KeyError, TypeError, ValueError) as e:
            log.warning("dstt: discarding the rest of staging ring %s: %s", ring, e)
        finally:  # a store error propagates and keeps the ring for the next try
            maps.clear()
        shutil.rmtree(ring, ignore_errors=True)
    return done
