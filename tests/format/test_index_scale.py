"""Index rows (format version 4, docs/format.md "Index rows") and the
per-tensor cost of the step index (issue 16): round trips of many tensors,
rows parsed exactly as the object entries they replace, hostile rows
refused with clear errors, and older readers refusing a store with rows."""

from __future__ import annotations

import gc as pygc
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dstt
from dstt.errors import CorruptStoreError, FormatVersionError
from dstt.format import layout as L
from dstt.format.manifest import (
    MAX_TREE_DEPTH,
    index_document,
    parse_commit,
    parse_index,
    sha256_hex,
    tensor_checksum,
)
from dstt.format.pygc import paused_gc

DSTT_PACKING = True  # tests/conftest.py: packing on (the default outside the suite)


def many_state(n: int) -> dict[str, Any]:
    """``n`` small tensors of varied dtypes and shapes (incl. 0-d, empty,
    bit dtypes, an ndarray) and one tensor too big to pack."""
    g = torch.Generator().manual_seed(7)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool, torch.float64]
    layers: dict[str, Any] = {}
    for i in range(n):
        dt = dtypes[i % len(dtypes)]
        shape = [(), (5,), (3, 4), (0,), (2, 3, 2)][i % 5]
        t = torch.randn(shape, generator=g) * 100
        layers[f"p{i}"] = t.to(dt) if dt != torch.bool else t > 0
    return {"model": layers, "big": torch.randn(700, 600, generator=g), "arr": np.arange(6, dtype=np.int32),
            "meta": {"lr": 0.1, "nested": [1, (2, 3)]}}


def same(a: Any, b: Any) -> None:
    """Bit-exact equality of nested states (tensors and arrays by their bytes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        if a.numel():
            assert a.contiguous().reshape(-1).view(torch.uint8).equal(b.contiguous().reshape(-1).view(torch.uint8))
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    else:
        assert type(a) is type(b) and a == b


def index_of(store: Path, step: int) -> dict[str, Any]:
    return json.loads((store / L.step_dir("main", step) / L.INDEX_FILE).read_bytes())


def rewrite_index(store: Path, step: int, doc: dict[str, Any]) -> None:
    """Replace a step's index.json and record it in its commit (as a hostile
    store would, so the commit's sha256 check passes)."""
    where = store / L.step_dir("main", step)
    data = json.dumps(doc).encode()
    (where / L.INDEX_FILE).write_bytes(data)
    commit = json.loads((where / L.COMMIT_FILE).read_bytes())
    commit["files"][L.INDEX_FILE] = {"sha256": sha256_hex(data), "size": len(data)}
    (where / L.COMMIT_FILE).write_bytes(json.dumps(commit).encode())


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "run"


def test_many_tensors_round_trip_bit_exact_as_index_rows(store: Path) -> None:
    state = many_state(3000)
    dstt.save(store, 0, state)
    changed = {**state, "model": {**state["model"], "p7": state["model"]["p7"] + 1}}
    dstt.save(store, 1, changed)
    doc = index_of(store, 0)
    assert doc["format_version"] == L.ROWS_FORMAT_VERSION
    rows = [t for t in doc["tensors"] if isinstance(t, list)]
    objects = [t["name"] for t in doc["tensors"] if isinstance(t, dict)]
    # every packable one-chunk tensor is a row; the big one and the empty
    # ones (no chunk to pack) stay objects
    assert len(rows) == 3000 - 600 + 1 and "big" in objects and "model/p3" in objects
    assert len(doc["types"]) < 40  # one per (kind, dtype, shape, codec)
    root = json.loads((store / "zarr.json").read_bytes())
    assert root["attributes"]["dstt"]["format_version"] == L.ROWS_FORMAT_VERSION
    run = dstt.open(store)
    assert run.commit_info(0)["format_version"] == L.ROWS_FORMAT_VERSION
    same(state, run.state_dict(0))
    same(changed, run.state_dict(1))
    # a fresh process-level parse (not the writer's remembered entries) too
    from dstt.format import manifest

    manifest._LAST_INDEX = None
    same(changed, dstt.open(store).state_dict(1))
    # stats are attached lazily, per tensor, and right
    info = {t.name: t for t in run.tensors(1)}
    p7 = changed["model"]["p7"].double()
    assert info["model/p7"].stats["numel"] == p7.numel()
    assert info["model/p7"].stats["max"] == p7.max().item()
    assert info["model/p7"].stats["norm"] == pytest.approx(p7.norm().item())
    # the unchanged tensors of step 1 reference step 0's pack ranges
    e0, e1 = run.entry("model/p8", 0), run.entry("model/p8", 1)
    assert e1.slots == e0.slots and e1.packs == e0.packs and e1.checksum == tensor_checksum(e1.crcs)


def test_rows_parse_exactly_as_the_object_entries_they_replace(store: Path) -> None:
    state = many_state(400)
    dstt.save(store, 0, state)
    data = (store / L.step_dir("main", 0) / L.INDEX_FILE).read_bytes()
    entries, tree = parse_index(data, "v4")
    # the same entries written as objects (format 3, what older dstt wrote)
    as_objects = index_document(L.PACK_FORMAT_VERSION, "main", 0, entries, tree)
    assert b'"types"' not in as_objects and all(isinstance(t, dict) for t in json.loads(as_objects)["tensors"])
    old_entries, old_tree = parse_index(as_objects, "v3")
    assert old_entries == entries and old_tree == tree
    for a, b in zip(old_entries, entries):
        assert a.chunk_grid == b.chunk_grid and a.checksum == b.checksum and a.pack(0) == b.pack(0)
    # writing the parsed entries again gives the stored bytes back
    assert index_document(L.ROWS_FORMAT_VERSION, "main", 0, entries, tree) == data
    # the checksum a row does not store is the sha256 of its CRC, as for objects
    row = next(t for t in json.loads(data)["tensors"] if isinstance(t, list))
    e = next(e for e in entries if e.name == row[0])
    assert e.checksum == tensor_checksum([row[4]]) and len(row) == 11


def test_a_store_without_packing_keeps_object_entries_and_format_1(store: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSTT_PACK_CHUNK_BYTES", "0")
    dstt.save(store, 0, {"a": torch.ones(3), "b": torch.arange(4)})
    doc = index_of(store, 0)
    assert doc["format_version"] == L.FORMAT_VERSION and "types" not in doc
    assert all(isinstance(t, dict) for t in doc["tensors"])
    same({"a": torch.ones(3), "b": torch.arange(4)}, dstt.open(store).state_dict(0))


def test_an_older_reader_refuses_a_store_with_rows(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dstt.save(store, 0, {"a": torch.ones(3)})
    commit = (store / L.step_dir("main", 0) / L.COMMIT_FILE).read_bytes()
    monkeypatch.setattr(L, "READ_VERSIONS", (1, 2, 3))
    with pytest.raises(FormatVersionError, match="format version 4"):
        dstt.open(store)
    from dstt.format import manifest

    monkeypatch.setattr(manifest, "READ_VERSIONS", (1, 2, 3))
    with pytest.raises(FormatVersionError, match="format version 4"):
        parse_commit(commit, "step 0")


def _v4_doc() -> dict[str, Any]:
    return {"format_version": 4, "branch": "main", "step": 0,
            "types": [["tensor", "float32", [4], [4], [{"name": "bytes", "configuration": {"endian": "little"}},
                                                      {"name": "crc32c"}]]],
            "tensors": [["w", 0, "tensors/w/@float32_4_c4_raw", 0, 7, None, 20, 0, 0, 0, 20]],
            "objects": {"w": {"$tensor": "w"}}}


def _with(path: str, value: Any) -> bytes:
    doc = _v4_doc()
    if path.startswith("row"):
        doc["tensors"][0][int(path[3:])] = value
    elif path.startswith("type") and path != "types":
        doc["types"][0][int(path[4:])] = value
    else:
        doc[path] = value
    return json.dumps(doc).encode()


@pytest.mark.parametrize("path,value,message", [
    ("row0", 3, "name must be a string"),
    ("row1", 1, "type 1 out of range"),
    ("row1", True, "type must be an integer, got bool"),
    ("row2", "tensors/../../etc/@x", "unsafe array path"),
    ("row2", "tensors/w/zarr.json", "unsafe array path"),
    ("row3", -1, "slot -1 out of range"),
    ("row3", 1 << 40, "out of range"),
    ("row4", 1 << 32, "crc 4294967296 out of range"),
    ("row4", 1.5, "crc must be an integer, got float"),
    ("row5", "ab", "sha256 must be null or 64 hex"),
    ("row6", -5, "written -5 out of range"),
    ("row9", "x", "pack offset must be an integer, got str"),
    ("row10", 2, "pack length 2 out of range"),
    ("type1", "complex512", "unknown dtype"),
    ("type0", "sparse", "unknown kind"),
    ("type3", [2, 2], "chunk_shape rank differs"),
    ("type3", [2], "chunk_shape must equal its shape"),
    ("type2", [1 << 50], "out of range"),
    ("type4", [{"name": "gzip"}], "unsupported codec chain"),
    ("types", {"a": 1}, "types must be a list"),
    ("format_version", 3, "only in indexes of format version 4"),
])
def test_hostile_rows_are_refused_with_clear_errors(path: str, value: Any, message: str) -> None:
    with pytest.raises(CorruptStoreError, match=message):
        parse_index(_with(path, value), "index.json")


def test_hostile_row_shapes_are_refused() -> None:
    doc = _v4_doc()
    doc["tensors"][0] = doc["tensors"][0][:10]
    with pytest.raises(CorruptStoreError, match="an index row must be"):
        parse_index(json.dumps(doc).encode(), "index.json")
    doc = _v4_doc()
    doc["tensors"].append(list(doc["tensors"][0]))
    with pytest.raises(CorruptStoreError, match="duplicate tensor names"):
        parse_index(json.dumps(doc).encode(), "index.json")
    doc = _v4_doc()
    del doc["types"]
    with pytest.raises(CorruptStoreError, match="type 0 out of range"):
        parse_index(json.dumps(doc).encode(), "index.json")
    # the good document parses: the test above changes one thing at a time
    (e,), _ = parse_index(json.dumps(_v4_doc()).encode(), "index.json")
    assert (e.name, e.shape, e.slots, e.crcs, e.pack(0)) == ("w", (4,), [0], [7], (0, 0, 0, 20))


def test_a_deep_value_tree_beside_rows_is_refused() -> None:
    doc = _v4_doc()
    deep: Any = {"$tensor": "w"}
    for _ in range(MAX_TREE_DEPTH + 1):
        deep = [deep]
    doc["objects"] = {"w": deep}
    with pytest.raises(CorruptStoreError, match="nested more than"):
        parse_index(json.dumps(doc).encode(), "index.json")


def test_a_tampered_row_in_a_store_is_caught_by_reads_and_verify(store: Path) -> None:
    dstt.save(store, 0, {"a": torch.arange(8.0), "b": torch.ones(4)})
    doc = index_of(store, 0)
    row = next(t for t in doc["tensors"] if t[0] == "a")
    row[4] ^= 1  # the CRC the index records for "a"
    rewrite_index(store, 0, doc)
    with pytest.raises(dstt.errors.ChecksumMismatchError, match="CRC-32C does not match the step index"):
        dstt.open(store).read("a", 0)
    with pytest.raises(dstt.errors.ChecksumMismatchError):
        dstt.open(store).state_dict(0)
    problems = dstt.verify(store).problems
    assert any(p.tensor == "a" for p in problems)
    assert dstt.open(store).read("b", 0).equal(torch.ones(4))
    row[3] = "x"
    rewrite_index(store, 0, doc)
    with pytest.raises(CorruptStoreError, match="tensor 'a': slot must be an integer, got str"):
        dstt.open(store).read("b", 0)


def test_verify_gc_diff_history_export_read_a_store_with_rows(store: Path) -> None:
    s0 = {"w": {f"l{i}": torch.full((3,), float(i)) for i in range(50)}}
    s1 = {"w": {**s0["w"], "l3": torch.zeros(3)}}
    dstt.save(store, 0, s0)
    dstt.save(store, 1, s1)
    assert dstt.verify(store).ok
    run = dstt.open(store)
    changed = [d["name"] for d in run.diff(0, 1) if d["status"] != "unchanged"]
    assert changed == ["w/l3"]
    hist = run.history("w/l3", stat="max")
    assert [h["value"] for h in hist] == [3.0, 0.0]
    dstt.export(f"{store}:1", store.parent / "out.pt")
    same(s1, torch.load(store.parent / "out.pt", weights_only=True))
    from dstt.api import gc
    from dstt.format.gc import prune

    prune(store, keep_last=1)
    gc(store)
    same(s1, dstt.open(store).state_dict(1))
    assert dstt.verify(store).ok


def test_paused_gc_restores_the_collector_state() -> None:
    assert pygc.isenabled()
    with paused_gc():
        assert not pygc.isenabled()
    assert pygc.isenabled()
    pygc.disable()
    try:
        with paused_gc():
            pass
        assert not pygc.isenabled()  # a caller's gc.disable() is kept
    finally:
        pygc.enable()
    with pytest.raises(ValueError), paused_gc():
        raise ValueError("boom")
    assert pygc.isenabled()


def test_docs_row_recipe_gives_the_entries_dstt_parses(store: Path) -> None:
    """docs/format.md "Index rows": its object form of a row, run as written,
    parses (with the derived checksum) to exactly what dstt reads."""
    import re

    from dstt.format.manifest import parse_entry

    doc = (Path(__file__).resolve().parents[2] / "docs" / "format.md").read_text()
    section = doc.split("### Index rows", 1)[1].split("\n## ", 1)[0]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[-1]
    dstt.save(store, 0, many_state(60))
    step_dir = L.step_dir("main", 0)
    scope: dict[str, Any] = {"json": json, "store": str(store), "step_dir": step_dir}
    exec(code, scope)  # noqa: S102 - the documented recipe itself
    got = [parse_entry({**e, "checksum": e.get("checksum") or tensor_checksum(e["crcs"])}, "doc")
           for e in scope["entries"]]
    want, _ = parse_index((store / step_dir / L.INDEX_FILE).read_bytes(), "index")
    assert got == want and "types" in scope["doc"]


def test_commit_refuses_missing_duplicate_and_extra_chunk_results(store: Path) -> None:
    """The committer's chunk accounting (one dict keyed by (tensor, chunk)):
    a missing, a repeated or an out-of-grid chunk result fails the step and
    commits nothing; the results as flushed commit."""
    import dataclasses

    from dstt.errors import CaptureError
    from dstt.store.writer import Writer

    state = {"a": torch.ones(4), "b": torch.arange(3.0)}
    with Writer(store) as w:
        for step, (edit, message) in enumerate([
            (lambda rs: rs[1:], "0 of 1 chunks were written"),
            (lambda rs: rs + rs[:1], "was written twice"),
            (lambda rs: rs + [dataclasses.replace(rs[0], index=1)], "2 of 1 chunks were written"),
        ]):
            plan = w.plan(step, state)
            w.ensure_arrays(plan)
            results, error = w.flush_chunks(plan, plan.tasks)
            assert error is None and len(results) == 2
            with pytest.raises(CaptureError, match=message):
                w.commit(plan, edit(results))
            assert not w.is_stored(step)
        plan = w.plan(3, state)
        w.ensure_arrays(plan)
        results, _ = w.flush_chunks(plan, plan.tasks)
        w.commit(plan, results)
    same(state, dstt.open(store).state_dict(3))


def test_tensor_names_lists_what_unflatten_loads_in_order() -> None:
    """state_dict reads the tensors tree.tensor_names lists (not a first
    unflatten): the same names in the same order, pickles refused up front."""
    from dstt.errors import PickleNotAllowedError
    from dstt.store.tree import flatten, tensor_names, unflatten

    state = {"m": {"w": torch.ones(2), 3: torch.zeros(1), "$x": [torch.ones(1), (np.ones(2), {"k": torch.ones(3)})]},
             "opt": [{"step": 1, "t": torch.ones(1)}], "obj": {1, 2}, "b": b"x", "dt": torch.float16}
    tree, _, _ = flatten(state, allow_pickle=True)
    loaded: list[str] = []
    unflatten(tree, lambda n, k: loaded.append(n), allow_pickle=True)
    assert tensor_names(tree, allow_pickle=True) == loaded and len(loaded) == 6
    with pytest.raises(PickleNotAllowedError):
        tensor_names(tree)
