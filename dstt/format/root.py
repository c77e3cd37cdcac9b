"""Store root and branch documents, shared by the writer and the reader."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from dstt.errors import (
    BranchExistsError,
    BranchNotFoundError,
    FormatVersionError,
    NotADsttStoreError,
    StepNotFoundError,
    StoreNotFoundError,
)
from dstt.format import layout as L
from dstt.format.backends import Backend
from dstt.format.codecs.spec import group_metadata
from dstt.format.layout import StepRef
from dstt.format.manifest import decode_json, encode_json, parse_branch


@dataclass(frozen=True)
class BranchInfo:
    """A branch: its slot-space id and where it forked from (None for roots)."""

    name: str
    id: int
    parent: StepRef | None
    created: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "id": self.id,
            "parent": None if self.parent is None else {"branch": self.parent[0], "step": self.parent[1]},
            "created": self.created,
        }


def check_root(backend: Backend) -> dict[str, Any]:
    """Validate the root group; the dstt attributes, or a clear error."""
    raw = backend.get("zarr.json", max_bytes=L.MAX_DOC_BYTES)
    if raw is None:
        if backend.directories or backend.list_dir(""):
            raise NotADsttStoreError(f"{backend.url} is not a dstt store (no zarr.json with dstt attributes)")
        raise StoreNotFoundError(f"no store at {backend.url}")
    doc = decode_json(raw, f"{backend.url}/zarr.json")
    attrs = doc.get("attributes", {}).get("dstt") if isinstance(doc, dict) and isinstance(doc.get("attributes"), dict) else None
    if not isinstance(attrs, dict) or attrs.get("format") != L.FORMAT_NAME:
        raise NotADsttStoreError(f"{backend.url} is a Zarr group but not a dstt store")
    if attrs.get("format_version") not in L.READ_VERSIONS:
        raise FormatVersionError(
            f"{backend.url} has dstt format version {attrs.get('format_version')!r}; "
            f"this dstt reads versions {' and '.join(map(str, L.READ_VERSIONS))}"
        )
    return attrs


def raise_root_version(backend: Backend, version: int) -> None:
    """Record in the root group that the store holds steps of format
    ``version`` (delta coding: 2), so readers that know only older versions
    refuse the store instead of misreading its steps. Idempotent; never lowers."""
    raw = backend.get("zarr.json", max_bytes=L.MAX_DOC_BYTES)
    if raw is None:
        return
    doc = decode_json(raw, f"{backend.url}/zarr.json")
    attrs = doc["attributes"]["dstt"]
    if attrs.get("format_version", 0) >= version:
        return
    attrs["format_version"] = version
    backend.put_atomic("zarr.json", group_metadata(doc["attributes"]))


def ensure_root(backend: Backend) -> None:
    """Create the root, ``tensors`` and ``meta`` groups of a new store.

    An existing directory with other content is never taken over.
    """
    if backend.get("zarr.json", max_bytes=L.MAX_DOC_BYTES) is not None:
        check_root(backend)
        return
    if backend.list_dir("") and not _interrupted_creation(backend):
        raise NotADsttStoreError(
            f"{backend.url} is not empty and is not a dstt store; refusing to write into it"
        )
    from dstt._version import __version__

    attrs = {"dstt": {"format": L.FORMAT_NAME, "format_version": L.FORMAT_VERSION,
                      "created": time.time(), "writer": f"dstt {__version__}"}}
    backend.put(f"{L.TENSORS}/zarr.json", group_metadata())
    backend.put(f"{L.META}/zarr.json", group_metadata({"dstt": "metadata; see docs/format.md"}))
    backend.sync()
    backend.put_if_absent("zarr.json", group_metadata(attrs))


def _interrupted_creation(backend: Backend) -> bool:
    """True when the directory holds only what a store creation killed before
    writing the root zarr.json leaves behind (so the next writer finishes it)."""
    keys = {k for k in backend.list_prefix("") if ".tmp-" not in k}
    return keys <= {f"{L.TENSORS}/zarr.json", f"{L.META}/zarr.json"}


def list_branches(backend: Backend) -> list[str]:
    return L.branch_names(backend.list_dir(L.BRANCHES_DIR))


def load_branch(backend: Backend, name: str) -> BranchInfo:
    L.validate_branch(name)
    raw = backend.get(L.branch_key(name), max_bytes=L.MAX_DOC_BYTES)
    if raw is None:
        known = ", ".join(list_branches(backend)) or "none"
        raise BranchNotFoundError(f"no branch {name!r} in {backend.url} (branches: {known})")
    doc = parse_branch(raw, L.branch_key(name))
    parent = doc.get("parent")
    return BranchInfo(
        name=name,
        id=doc["id"],
        parent=None if parent is None else StepRef(parent["branch"], parent["step"]),
        created=float(doc.get("created", 0.0)),
    )


def create_branch(backend: Backend, name: str, parent: tuple[str, int] | None) -> BranchInfo:
    """Create a branch document, claiming the lowest free branch id.

    Holds the branch-set lock, which prune and gc hold throughout: a branch
    never forks from a step being deleted. A parent step is checked again
    under that lock."""
    from dstt.format.lock import branch_set_lock

    L.validate_branch(name)
    if parent is not None:
        L.validate_branch(parent[0])
        L.validate_step(parent[1], "parent step")  # (a bool would be written as JSON true)
    with branch_set_lock(backend):
        if parent is not None and parent[1] not in committed_steps(backend, parent[0]):
            raise StepNotFoundError(f"parent step {parent[1]} is not committed on branch {parent[0]!r}")
        return _create_branch_locked(backend, name, parent)


def _create_branch_locked(backend: Backend, name: str, parent: tuple[str, int] | None) -> BranchInfo:
    from dstt.format.renames import refuse_if_renaming

    refuse_if_renaming(backend, name)  # (its step directories may be half copied)
    if backend.exists(L.branch_key(name)):
        raise BranchExistsError(f"branch {name!r} already exists in {backend.url}")
    taken = {int(n) for n in backend.list_dir(f"{L.META}/branch_ids") if n.isdigit()}
    bid = 0
    while True:
        while bid in taken:
            bid += 1
        if bid >= L.MAX_BRANCHES:
            raise BranchExistsError(f"{backend.url} has no free branch ids left")
        if backend.put_if_absent(L.branch_id_key(bid), name.encode()):
            break
        taken.add(bid)
    info = BranchInfo(name, bid, None if parent is None else StepRef(parent[0], int(parent[1])), time.time())
    if not backend.put_if_absent(L.branch_key(name), encode_json(info.to_dict())):
        raise BranchExistsError(f"branch {name!r} already exists in {backend.url}")
    return info


def committed_steps(backend: Backend, branch: str) -> list[int]:
    """Steps of a branch whose commit marker exists, ascending."""
    prefix = L.steps_prefix(branch).rstrip("/")
    out = []
    if not backend.directories:
        # Object stores: one flat listing (a request per 1,000 keys) instead
        # of one existence check per step.
        suffix = "/" + L.COMMIT_FILE
        for key in backend.list_prefix(prefix):
            d = key[len(prefix) + 1:-len(suffix)] if key.startswith(prefix + "/") and key.endswith(suffix) else ""
            if d.isdigit() and len(d) == L.STEP_DIGITS:
                out.append(int(d))
        return sorted(out)
    for d in backend.list_dir(prefix):
        if d.isdigit() and len(d) == L.STEP_DIGITS and backend.exists(f"{prefix}/{d}/{L.COMMIT_FILE}"):
            out.append(int(d))
    return sorted(out)


def dumps_pretty(doc: Any) -> bytes:
    return json.dumps(doc, indent=2).encode()
