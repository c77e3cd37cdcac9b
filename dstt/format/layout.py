"""Where things live in a dstt store (format version 1; see docs/format.md).

::

    zarr.json                              root group, attributes.dstt = {format, format_version}
    tensors/zarr.json                      group holding one array per logical tensor
    tensors/<escaped name>/@<sig>/zarr.json  array of shape (MAX_SLOTS, *shape)
    tensors/<escaped name>/@<sig>/c.<slot>.<i>...  chunks (flat: no directory per step)
    meta/zarr.json                         group (keeps plain zarr listings quiet)
    meta/branches/<branch>.json            branch document (id, parent)
    meta/branch_ids/<id>                   claims a branch id (created exclusively)
    meta/steps/<branch>/<step:020d>/{index.json,names.json,stats.npy,commit.json}
    meta/locks/<branch>.lock               single-writer lock per branch
    meta/incidents/<branch>/<step:020d>-<unique>.json  incident records (dstt.format.incidents)

All keys are '/'-separated, relative to the store root, identical for local
paths and object stores.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from dstt.errors import CaptureError, InvalidNameError, StepOrderError

FORMAT_NAME = "dstt"
FORMAT_VERSION = 1
#: Steps (and stores) that use delta coding are format version 2; a store
#: is raised to 2 when a delta writer first opens it. Readers read both.
DELTA_FORMAT_VERSION = 2
#: Steps (and stores) with packed chunks are format version 3
#: (dstt.format.packs.PACK_FORMAT_VERSION): raised when the first is committed.
PACK_FORMAT_VERSION = 3
#: Steps (and stores) whose index.json holds compact rows for packed
#: one-chunk tensors (docs/format.md "Index rows") are format version 4:
#: raised when the first is committed.
ROWS_FORMAT_VERSION = 4
#: Steps (and stores) with predictive chunks (docs/format.md "Predictive
#: chunks": index entries with a ``pred`` record) are format version 5:
#: raised when the first is committed.
PRED_FORMAT_VERSION = 5
READ_VERSIONS = (1, 2, 3, 4, 5)
#: A delta-coded tensor's difference chunks live in the sibling array
#: ``<array>`` + DELTA_SUFFIX (docs/format.md "Delta chunks").
DELTA_SUFFIX = ".delta"

#: Length of the leading slot axis of every tensor array. Arrays are sparse:
#: a slot exists only once some step wrote its chunks, so the array metadata is
#: written once and never resized.
MAX_SLOTS = 1 << 40
#: Slots are partitioned by branch id so writers on different branches never
#: write the same chunk: slot = branch_id * SLOTS_PER_BRANCH + seq.
SLOTS_PER_BRANCH = 1 << 24
MAX_BRANCHES = MAX_SLOTS // SLOTS_PER_BRANCH

TENSORS = "tensors"
META = "meta"
STEP_DIGITS = 20
#: The largest step number: step directories have STEP_DIGITS digits.
MAX_STEP = 10**STEP_DIGITS - 1
#: Bound on a store document read whole without a recorded size (zarr.json,
#: branch documents, commit.json, head records, skip records): a hostile
#: store cannot make a reader allocate more (files with a recorded size are
#: read up to that size).
MAX_DOC_BYTES = 1 << 20

#: The Zarr v3 document of a group or an array (``zarr.json`` at the root: the store's).
ZARR_JSON = "zarr.json"
COMMIT_FILE = "commit.json"
INDEX_FILE = "index.json"
NAMES_FILE = "names.json"
STATS_FILE = "stats.npy"
#: Columns of ``stats.npy`` (float64, one row per tensor, index order);
#: computed at capture time by :mod:`dstt.store.stats`.
#: ``update_norm`` is ‖θₖ − θₖ₋₁‖ over the tensor (θₖ₋₁: the previous
#: captured step, persisted or not), ``update_ratio`` is update_norm / norm;
#: both NaN where the previous step was not at hand. Steps written before
#: they existed have the first 7 columns: the commit document's
#: ``stats_columns`` says which a step holds (missing ones read as NaN).
STATS_COLUMNS = ("numel", "nonfinite", "norm", "mean", "std", "min", "max", "update_norm", "update_ratio")
#: The columns of every stats.npy written before ``stats_columns`` could differ.
LEGACY_STATS_COLUMNS = STATS_COLUMNS[:7]

#: Longest escaped tensor-name component: a file name on common local filesystems.
MAX_COMPONENT_BYTES = 255
#: Longest array path; readers refuse longer ones (manifest.py), so writers must too.
MAX_ARRAY_PATH = 4096

_BRANCH_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SAFE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


class StepRef(NamedTuple):
    """A committed step of a branch: what ``Run.resolve`` returns and what
    ``parent=`` takes (beside reference strings such as ``"main:1200"``);
    public as ``dstt.StepRef``.

    >>> StepRef("main", 1200)
    StepRef(branch='main', step=1200)
    >>> branch, step = StepRef("main", 1200)
    """

    branch: str
    step: int


#: Where branch documents live (``<branch>.json`` each).
BRANCHES_DIR = f"{META}/branches"


def branch_names(listing: list[str]) -> list[str]:
    """Branch names, sorted, from a listing of :data:`BRANCHES_DIR`.

    >>> branch_names(["main.json", "side.json", "x.tmp-1"])
    ['main', 'side']
    """
    return sorted(n[: -len(".json")] for n in listing if n.endswith(".json"))


def validate_branch(name: object) -> str:
    """Branch names are like git refs' simplest form: ``[A-Za-z0-9][A-Za-z0-9._-]*``."""
    if not isinstance(name, str) or not _BRANCH_RE.match(name) or ".." in name:
        raise InvalidNameError(
            f"invalid branch name {name!r}: expected letters, digits, '.', '_' or '-' "
            "(starting with a letter or digit, at most 128 characters)"
        )
    return name


#: Components that are their own escape (the common case): matched whole.
_PLAIN_RE = re.compile(r"[A-Za-z0-9._-]+")
#: Memo of escaped components and of escaped name prefixes (planning calls
#: these per tensor per first sighting: tens of thousands of tensors share a
#: few component strings). Cleared when full, so never unbounded.
_ESCAPED: dict[str, str] = {}
_PREFIXES: dict[str, tuple[str, str | None]] = {}
_MEMO_MAX = 1 << 17


def escape_component(part: str) -> str:
    """Percent-encode one tensor-name component into a safe path component.

    The result only uses ``[A-Za-z0-9._%-]``, is never ``.``/``..``/empty and
    never starts with ``__`` (reserved by Zarr), so no tensor name can escape
    its array directory or collide with an ``@<sig>`` array node.

    >>> escape_component("layer.0"), escape_component("a b"), escape_component("__x")
    ('layer.0', 'a%20b', '%5F_x')
    """
    s = _ESCAPED.get(part)
    if s is not None:
        return s
    if _PLAIN_RE.fullmatch(part) and part not in (".", "..") and not part.startswith("__"):
        s = part
    else:
        s = _escape_slow(part)
    if len(_ESCAPED) >= _MEMO_MAX:
        _ESCAPED.clear()
    _ESCAPED[part] = s
    return s


def _escape_slow(part: str) -> str:
    if part in ("", ".", ".."):
        return "".join(f"%{ord(c):02X}" for c in part) or "%00"
    out = []
    for c in part:
        if c in _SAFE_CHARS:
            out.append(c)
        else:
            try:
                out.extend(f"%{b:02X}" for b in c.encode("utf-8"))
            except UnicodeEncodeError:  # a lone surrogate has no UTF-8 form
                raise InvalidNameError(f"tensor name component {part!r} is not valid Unicode") from None
    s = "".join(out)
    if s.startswith("__"):
        s = "%5F" + s[1:]
    return s


def _name_prefix(name: str) -> tuple[str, str | None]:
    """``tensors/<escaped components>`` and the first escaped component
    longer than MAX_COMPONENT_BYTES, if any (memoized per name)."""
    got = _PREFIXES.get(name)
    if got is None:
        parts = [escape_component(p) for p in name.split("/")]
        got = ("/".join([TENSORS, *parts]), next((p for p in parts if len(p) > MAX_COMPONENT_BYTES), None))
        if len(_PREFIXES) >= _MEMO_MAX:
            _PREFIXES.clear()
        _PREFIXES[name] = got
    return got


def array_path(name: str, sig: str) -> str:
    """The array node path of a logical tensor with a given array signature.

    Refuses (InvalidNameError) names whose path no store could hold or no
    reader would accept, so a writer never commits a step it cannot read.

    >>> array_path("model/layer.0/w", "f32_4_c4_raw")
    'tensors/model/layer.0/w/@f32_4_c4_raw'
    """
    prefix, long = _name_prefix(name)
    last = "@" + sig
    if long is None and len(last) > MAX_COMPONENT_BYTES:
        long = last
    if long is not None:
        raise InvalidNameError(
            f"tensor name {name[:80]!r}: path component {long[:40]}... is {len(long)} bytes, "
            f"at most {MAX_COMPONENT_BYTES} fit in a file name")
    path = prefix + "/" + last
    if len(path) > MAX_ARRAY_PATH:
        raise InvalidNameError(
            f"tensor name {name[:80]!r}... is nested too deeply: its array path has {len(path)} "
            f"characters, at most {MAX_ARRAY_PATH}")
    return path


def validate_step(step: object, what: str = "step") -> int:
    """A step number as every entry point takes it: an int (not a bool) in
    ``0..MAX_STEP`` (its directory name has STEP_DIGITS digits); anything
    else is a StepOrderError (a ValueError) naming the value.

    >>> validate_step(12)
    12
    >>> validate_step(10**20)
    Traceback (most recent call last):
    dstt.errors.StepOrderError: step must be an integer in 0..99999999999999999999, got 100000000000000000000
    """
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        shown = repr(step) if len(repr(step)) <= 60 else repr(step)[:60] + "..."
        raise StepOrderError(f"{what} must be an integer in 0..{MAX_STEP}, got {shown}")
    return step


def step_dir(branch: str, step: int) -> str:
    return f"{META}/steps/{branch}/{step:0{STEP_DIGITS}d}"


def zarr_json_key(path: str) -> str:
    """The key of the Zarr document of the group or array at ``path`` (``""``: the root).

    >>> zarr_json_key("tensors/model"), zarr_json_key("")
    ('tensors/model/zarr.json', 'zarr.json')
    """
    return f"{path}/{ZARR_JSON}" if path else ZARR_JSON


def steps_prefix(branch: str) -> str:
    return f"{META}/steps/{branch}/"


def branch_key(branch: str) -> str:
    return f"{META}/branches/{branch}.json"


def branch_id_key(branch_id: int) -> str:
    return f"{META}/branch_ids/{branch_id}"


def lock_key(branch: str) -> str:
    return f"{META}/locks/{branch}.lock"


#: Skip records: steps a Capture's skip policy dropped (not steps; see
#: docs/format.md "Skip records" and :func:`dstt.format.manifest.parse_skip`).
SKIPS_DIR = f"{META}/skips"


def skips_prefix(branch: str) -> str:
    return f"{SKIPS_DIR}/{branch}/"


def skip_key(branch: str, step: int) -> str:
    """``meta/skips/<branch>/<step:020d>.json``."""
    return f"{SKIPS_DIR}/{branch}/{step:0{STEP_DIGITS}d}.json"


#: Incident records (issue 14; :mod:`dstt.format.incidents`): one JSON
#: document per incident, ``meta/incidents/<branch>/<step:020d>-<unique>.json``.
INCIDENTS_DIR = f"{META}/incidents"


def incidents_prefix(branch: str) -> str:
    return f"{INCIDENTS_DIR}/{branch}/"


#: Zarr v3 "default" chunk key encoding with "." as separator: every chunk of
#: an array is a file directly in the array's directory, so a step creates
#: files but no directories (a "/" separator made ~2 mkdirs per tensor per step).
CHUNK_SEPARATOR = "."


def chunk_key(array: str, slot: int, chunk_coords: tuple[int, ...]) -> str:
    """The key of a chunk: ``<array>/c.<slot>.<i0>.<i1>...``."""
    return f"{array}/" + CHUNK_SEPARATOR.join(["c", str(slot), *map(str, chunk_coords)])


def slot_for(branch_id: int, seq: int) -> int:
    if not 0 <= seq < SLOTS_PER_BRANCH:
        raise CaptureError(
            f"step sequence {seq} is beyond the {SLOTS_PER_BRANCH} steps one branch can hold; "
            "continue on a new branch")
    return branch_id * SLOTS_PER_BRANCH + seq


def step_ranges(steps: list[int]) -> list[tuple[int, int]]:
    """Sorted steps as inclusive ``(first, last)`` runs of consecutive steps.

    >>> step_ranges([1, 2, 3, 5, 8, 9])
    [(1, 3), (5, 5), (8, 9)]
    """
    out: list[tuple[int, int]] = []
    for s in steps:
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out
