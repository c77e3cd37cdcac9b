"""Untrusted stores: opening and inspecting someone else's store never runs
code from it, and hostile or malformed metadata gives a clear DsttError --
never another exception, never a read or write outside the store.

The manifest, index, commit, names and stats readers and the value-tree
decoder are fuzzed with hypothesis: a bounded budget in the default suite,
a larger one under ``-m slow``.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dstt
from dstt.errors import CorruptStoreError, DsttError, PickleNotAllowedError
from dstt.format import layout as L
from dstt.format.backends import check_key
from dstt.format.manifest import (
    decode_stats,
    encode_json,
    parse_branch,
    parse_commit,
    parse_index,
    parse_names,
    sha256_hex,
)
from dstt.format.verify import verify
from dstt.store.tree import unflatten

FAST = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
SLOW = settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))

json_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12), st.sampled_from(["../../x", "/etc/passwd", "tensors/../../x/@s", "$pickle", "\udcff"]),
)
json_values = st.recursive(
    json_leaves,
    lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8) | st.sampled_from(
        ["$tensor", "$ndarray", "$pickle", "$dict", "$tuple", "$np", "$float", "$bytes", "$dtype"]), c, max_size=4)),
    max_leaves=12,
)
HOSTILE = [
    None, -1, 2**63, -(2**70), 1.5, "x", [], {}, [-1], [2**40, 2**40], [0], [1] * 40, ["a"],
    "../../x", "/abs/x", "tensors/../../x/@s", "tensors/a/../../../x/@s", "tensors/x", "tensors//@s",
    "tensors\\..\\x/@s", "tensors/a/@s\x00", [[1, 2]], True, "\udcff",
]

# ----------------------------------------------------------------------------- byte-level fuzz


def only_dstt_errors(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except DsttError:
        return None


def _bytes_fuzz(data: bytes) -> None:
    only_dstt_errors(parse_commit, data, "w")
    only_dstt_errors(parse_index, data, "w")
    only_dstt_errors(parse_names, data, "w")
    only_dstt_errors(parse_branch, data, "w")
    only_dstt_errors(decode_stats, data, 2, "w")


@FAST
@given(st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_readers_take_any_bytes(data: bytes) -> None:
    _bytes_fuzz(data)


@pytest.mark.slow
@SLOW
@given(st.binary(max_size=2000) | json_values.map(lambda v: json.dumps(v).encode()))
def test_readers_take_any_bytes_many(data: bytes) -> None:
    _bytes_fuzz(data)


# ----------------------------------------------------------------------------- structure-aware fuzz of the index


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("tpl") / "run"
    dstt.save(path, 0, {"model": {"w": torch.randn(4, 6), "b": torch.ones(3)}, "lr": 0.1, "n": torch.arange(3).numpy()})
    where = path / L.step_dir("main", 0)
    return {
        "index": json.loads((where / "index.json").read_bytes()),
        "commit": json.loads((where / "commit.json").read_bytes()),
        "names": json.loads((where / "names.json").read_bytes()),
    }


def mutate(doc: Any, path: list[Any], value: Any) -> Any:
    doc = json.loads(json.dumps(doc))
    cur = doc
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value
    return doc


ENTRY_FIELDS = ["name", "kind", "dtype", "shape", "chunk_shape", "codec", "array", "slots", "crcs",
                "sha256", "checksum", "written"]


def _index_fuzz(template: dict[str, Any], i: int, fieldname: str, value: Any) -> None:
    idx = template["index"]
    i = i % len(idx["tensors"])
    doc = mutate(idx, ["tensors", i, fieldname], value)
    try:
        entries, _ = parse_index(encode_json(doc), "w")
    except DsttError:
        return
    for e in entries:  # whatever parsed is safe to use
        for k in range(min(e.nchunks, 4)):
            check_key(L.chunk_key(e.array, e.slots[k], e.coords(k)))
        assert e.array.startswith("tensors/") and ".." not in e.array.split("/")
        assert 0 <= min(e.slots, default=0) and max(e.slots, default=0) < L.MAX_SLOTS


@FAST
@given(st.integers(0, 5), st.sampled_from(ENTRY_FIELDS), st.sampled_from(HOSTILE) | json_values)
def test_index_entry_fuzz(template: dict[str, Any], i: int, fieldname: str, value: Any) -> None:
    _index_fuzz(template, i, fieldname, value)


@pytest.mark.slow
@SLOW
@given(st.integers(0, 5), st.sampled_from(ENTRY_FIELDS), st.sampled_from(HOSTILE) | json_values)
def test_index_entry_fuzz_many(template: dict[str, Any], i: int, fieldname: str, value: Any) -> None:
    _index_fuzz(template, i, fieldname, value)


COMMIT_FIELDS = ["format_version", "step", "seq", "files", "bytes_written", "bytes_referenced", "n_tensors", "time"]


def _commit_fuzz(template: dict[str, Any], fieldname: str, value: Any) -> None:
    only_dstt_errors(parse_commit, encode_json(mutate(template["commit"], [fieldname], value)), "w")
    for f in template["commit"]["files"]:
        doc = mutate(template["commit"], ["files", f], value)
        only_dstt_errors(parse_commit, encode_json(doc), "w")


@FAST
@given(st.sampled_from(COMMIT_FIELDS), st.sampled_from(HOSTILE) | json_values)
def test_commit_fuzz(template: dict[str, Any], fieldname: str, value: Any) -> None:
    _commit_fuzz(template, fieldname, value)


@pytest.mark.slow
@SLOW
@given(st.sampled_from(COMMIT_FIELDS), st.sampled_from(HOSTILE) | json_values)
def test_commit_fuzz_many(template: dict[str, Any], fieldname: str, value: Any) -> None:
    _commit_fuzz(template, fieldname, value)


# ----------------------------------------------------------------------------- value tree


class Boom:
    """Unpickling this creates a file: proof that code ran."""

    sentinel = ""

    def __reduce__(self) -> Any:
        return (open, (self.sentinel, "w"))


@FAST
@given(json_values)
def test_value_tree_decoder_fuzz(tree: Any) -> None:
    def load(name: str, kind: str) -> Any:
        assert isinstance(name, str) and kind in ("tensor", "ndarray")
        return None

    only_dstt_errors(lambda: unflatten(tree, load, allow_pickle=False))


@pytest.mark.slow
@SLOW
@given(json_values)
def test_value_tree_decoder_fuzz_many(tree: Any) -> None:
    only_dstt_errors(lambda: unflatten(tree, lambda n, k: None, allow_pickle=False))


@pytest.mark.parametrize("tree", [
    {"$np": ["int8", 1000]}, {"$np": ["datetime64", 1]}, {"$np": ["V8", 1]}, {"$np": ["float32", "x"]},
    {"$np": ["int64", [1, 2]]}, {"$np": ["U5", [1]]}, {"$np": ["(100000000000000000000,)f8", 1]},
    {"$dtype": "_dynamo"}, {"$dtype": "manual_seed"},
    json.loads("[" * 800 + "]" * 800), json.loads('{"a":' * 800 + "1" + "}" * 800),
])
def test_value_tree_holes_found_by_fuzzing(tree: Any) -> None:
    """Found while fuzzing: each raised OverflowError/ValueError/RecursionError or
    built a non-numeric numpy value; now a CorruptStoreError."""
    with pytest.raises(CorruptStoreError):
        unflatten(tree, lambda n, k: None)


def test_numpy_float_nan_round_trips(tmp_path: Path) -> None:
    """Found while fuzzing: np.float64 is a float subclass, and a NaN one was
    stored as {"$float": "np.float64(nan)"}, making the whole step unreadable."""
    import numpy as np

    dstt.save(tmp_path / "run", 0, {"w": torch.ones(1), "loss": np.float64("nan"), "x": np.float32("-inf")})
    got = dstt.open(tmp_path / "run").state_dict(0)
    assert got["loss"] != got["loss"] and got["x"] == float("-inf")


def test_value_tree_never_unpickles_without_opt_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sentinel = tmp_path / "pwned"
    Boom.sentinel = str(sentinel)
    payload = base64.b64encode(pickle.dumps(Boom())).decode()
    for tree in ({"$pickle": payload}, [{"a": {"$pickle": payload}}], {"$dict": [[{"$pickle": payload}, 1]]},
                 {"$tuple": [{"$np": ["int64", {"$pickle": payload}]}]}):
        with pytest.raises(DsttError):
            unflatten(tree, lambda n, k: None)
    assert not sentinel.exists()
    unflatten({"$pickle": payload}, lambda n, k: None, allow_pickle=True)
    assert sentinel.exists()  # the negative control: the payload does run when allowed


# ----------------------------------------------------------------------------- whole stores


def write_step_files(path: Path, step: int = 0, *, index: Any = None, names: Any = None,
                     raw_index: bytes | None = None, raw_names: bytes | None = None) -> None:
    """Replace a committed step's files and re-sign the commit, as an attacker
    who controls the whole store would."""
    where = path / L.step_dir("main", step)
    commit = json.loads((where / "commit.json").read_bytes())
    for fname, doc, raw in (("index.json", index, raw_index), ("names.json", names, raw_names)):
        if doc is None and raw is None:
            continue
        data = raw if raw is not None else encode_json(doc)
        (where / fname).write_bytes(data)
        commit["files"][fname] = {"sha256": sha256_hex(data), "size": len(data)}
    (where / "commit.json").write_bytes(encode_json(commit))


def snapshot_tree(root: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*")}


def exercise(path: Path) -> None:
    """Everything a user does on a store they were handed; only DsttError allowed."""
    def guarded(fn: Any) -> None:
        try:
            fn()
        except DsttError:
            pass

    guarded(lambda: dstt.open(path).steps())
    try:
        run = dstt.open(path)
        infos = run.tensors(0)
    except DsttError:
        infos = []
    for info in infos:
        guarded(lambda: run.read(info.name, 0, verify=True))
        guarded(lambda: list(run.iter_chunks(info.name, 0)))
    guarded(lambda: run.state_dict(0))
    report = verify(path)
    assert isinstance(report.ok, bool)


def _store_fuzz(base: Path, template: dict[str, Any], i: int, fieldname: str, value: Any) -> None:
    import shutil

    path = base / "victim" / "run"
    if path.parent.exists():
        shutil.rmtree(path.parent)
    shutil.copytree(base / "pristine", path)
    idx = template["index"]
    doc = mutate(idx, ["tensors", i % len(idx["tensors"]), fieldname], value)
    write_step_files(path, index=doc)
    before = snapshot_tree(base)
    exercise(path)
    assert snapshot_tree(base) == before  # nothing written, inside or outside the store


@pytest.fixture(scope="module")
def fuzz_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("fuzz")
    dstt.save(base / "pristine", 0, {"model": {"w": torch.randn(4, 6), "b": torch.ones(3)}, "lr": 0.1,
                                     "n": torch.arange(3).numpy()})
    (base / "secret").mkdir()
    (base / "secret" / "c").mkdir()
    return base


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(st.integers(0, 5), st.sampled_from(ENTRY_FIELDS), st.sampled_from(HOSTILE) | json_values)
def test_hostile_index_in_a_real_store(fuzz_base: Path, template: dict[str, Any], i: int, fieldname: str, value: Any) -> None:
    _store_fuzz(fuzz_base, template, i, fieldname, value)


@pytest.mark.slow
@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 5), st.sampled_from(ENTRY_FIELDS), st.sampled_from(HOSTILE) | json_values)
def test_hostile_index_in_a_real_store_many(fuzz_base: Path, template: dict[str, Any], i: int, fieldname: str, value: Any) -> None:
    _store_fuzz(fuzz_base, template, i, fieldname, value)


@pytest.mark.parametrize("array", ["tensors/../../secret/@x", "/tmp/x/@s", "tensors/a/../../../../secret/@s",
                                   "../secret/@s", "tensors/%2E%2E/@s", "tensors/a\\..\\..\\x/@s"])
def test_array_paths_cannot_escape(tmp_path: Path, template: dict[str, Any], array: str) -> None:
    path = tmp_path / "run"
    dstt.save(path, 0, {"model": {"w": torch.randn(4, 6), "b": torch.ones(3)}, "lr": 0.1, "n": torch.arange(3).numpy()})
    # A look-alike chunk outside the store, where a traversal would land.
    outside = tmp_path / "secret" / "c" / "0"
    outside.mkdir(parents=True)
    doc = mutate(template["index"], ["tensors", 0, "array"], array)
    write_step_files(path, index=doc)
    run = dstt.open(path)
    name = template["index"]["tensors"][0]["name"]
    try:
        run.read(name, 0)
    except CorruptStoreError as e:
        assert "unsafe" in str(e) or "missing" in str(e) or "CRC" in str(e)
    else:
        # Only a harmless in-store path may parse (percent-escapes are literal names).
        assert "%2E" in array


def test_huge_declared_shape_is_a_clear_error(tmp_path: Path, template: dict[str, Any]) -> None:
    """A shape within the index's bounds but far beyond memory (found while
    writing these tests: np.empty raised ValueError/MemoryError)."""
    path = tmp_path / "run"
    dstt.save(path, 0, {"w": torch.ones(3)})
    where = path / L.step_dir("main", 0)
    idx = json.loads((where / "index.json").read_bytes())
    n = 1 << 16
    idx["tensors"][0].update(shape=[n << 30], chunk_shape=[1 << 30], slots=[0] * n, crcs=[0] * n, sha256=[None] * n)
    write_step_files(path, index=idx)
    run = dstt.open(path)
    with pytest.raises(CorruptStoreError, match="cannot allocate"):
        run.read("w", 0)
    with pytest.raises(CorruptStoreError):
        run.read("w", 0, index=slice(0, 2))  # one chunk: its stored size is wrong


@pytest.mark.parametrize("case", ["non-utf8-names", "non-utf8-index", "truncated-index", "names-wrong-type",
                                  "absurd-shape", "negative-slot", "huge-slot", "wrong-chunk-count",
                                  "duplicate-names", "deep-nesting", "huge-integer"])
def test_malformed_metadata_is_a_clear_error(tmp_path: Path, template: dict[str, Any], case: str) -> None:
    path = tmp_path / "run"
    dstt.save(path, 0, {"model": {"w": torch.randn(4, 6), "b": torch.ones(3)}, "lr": 0.1, "n": torch.arange(3).numpy()})
    idx = template["index"]
    e0 = ["tensors", 0]
    kwargs: dict[str, Any] = {
        "non-utf8-names": {"raw_names": b'["\xff\xfe"]'},
        "non-utf8-index": {"raw_index": b'{"tensors": ["\xff"]}'},
        "truncated-index": {"raw_index": encode_json(idx)[:40]},
        "names-wrong-type": {"names": {"a": 1}},
        "absurd-shape": {"index": mutate(idx, e0 + ["shape"], [2**40, 2**40, 2**40])},
        "negative-slot": {"index": mutate(idx, e0 + ["slots"], [-1])},
        "huge-slot": {"index": mutate(idx, e0 + ["slots"], [2**62])},
        "wrong-chunk-count": {"index": mutate(idx, e0 + ["slots"], [0, 0, 0])},
        "duplicate-names": {"index": mutate(idx, ["tensors", 1], idx["tensors"][0])},
        "deep-nesting": {"raw_index": b"[" * 100000 + b"]" * 100000},
        # beyond Python's int digit limit: json.loads raised a plain ValueError
        "huge-integer": {"raw_index": b'{"tensors": [], "objects": ' + b"9" * 5000 + b"}"},
    }[case]
    write_step_files(path, **kwargs)
    with pytest.raises(DsttError) as info:
        dstt.open(path).state_dict(0)
    assert str(info.value) and "\n" not in str(info.value)


def test_readers_refuse_integers_beyond_the_digit_limit() -> None:
    """Found by hand beside the fuzzer (its integers stay below 2**70)."""
    data = b"9" * 5000
    for fn in (parse_commit, parse_index, parse_names, parse_branch):
        with pytest.raises(CorruptStoreError, match="not valid JSON"):
            fn(data, "w")


@pytest.mark.parametrize("field,value", [("id", 2**30), ("seq", 2**24)])
def test_out_of_range_branch_id_or_seq_is_refused_before_writing(tmp_path: Path, field: str, value: int) -> None:
    """A branch id beyond the slot axis made the next writer commit a step
    every reader then refused; a seq beyond a branch's slots raised a plain
    ValueError."""
    path = tmp_path / "run"
    dstt.save(path, 0, {"w": torch.ones(2)})
    doc_path = (path / L.branch_key("main")) if field == "id" else (path / L.step_dir("main", 0) / "commit.json")
    doc = json.loads(doc_path.read_bytes())
    doc[field] = value
    doc_path.write_bytes(encode_json(doc))
    chunks = sorted(p.name for p in path.rglob("c.*"))
    with pytest.raises(CorruptStoreError, match=f"{field} {value} out of range"):
        dstt.save(path, 1, {"w": torch.zeros(2)})
    assert sorted(p.name for p in path.rglob("c.*")) == chunks  # nothing written


def test_hostile_skip_records_are_a_clear_error(tmp_path: Path) -> None:
    from dstt.capture import skipped_steps

    path = tmp_path / "run"
    dstt.save(path, 0, {"w": torch.ones(2)})
    skips = path / "meta" / "skips" / "main"
    skips.mkdir(parents=True)
    for raw in (b"\xff", b"[1]", b'{"step": "x"}', b'{"step": ' + b"9" * 5000 + b"}"):
        (skips / "00000000000000000001.json").write_bytes(raw)
        with pytest.raises(CorruptStoreError):
            skipped_steps(path)


# ----------------------------------------------------------------------------- no code runs from a store


@pytest.fixture
def pickle_store(tmp_path: Path) -> tuple[Path, Path]:
    """A store whose step 1 holds a pickled value that creates a file when unpickled."""
    sentinel = tmp_path / "pwned"
    Boom.sentinel = str(sentinel)
    path = tmp_path / "run"
    dstt.save(path, 0, {"model": {"w": torch.ones(3)}, "extra": {"cfg": 1}})
    dstt.save(path, 1, {"model": {"w": torch.zeros(3)}, "extra": {"cfg": Boom()}}, allow_pickle=True)
    assert not sentinel.exists()
    return path, sentinel


def test_api_never_unpickles_without_opt_in(pickle_store: tuple[Path, Path]) -> None:
    path, sentinel = pickle_store
    run = dstt.open(path)
    run.steps(), run.tensors(1), run.read("model/w", 1), run.commit_info(1)
    with pytest.raises(PickleNotAllowedError):
        run.state_dict(1)
    assert verify(path).ok
    try:
        from dstt.timetravel.restore import restore
    except ImportError:
        restore = None
    if restore is not None:
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.ones(3))
        with pytest.raises(DsttError):
            restore(f"{path}:1", model=model, rng=False)
    assert not sentinel.exists()
    run.state_dict(1, allow_pickle=True)
    assert sentinel.exists()  # negative control


def test_cli_never_unpickles(pickle_store: tuple[Path, Path]) -> None:
    from typer.testing import CliRunner

    from dstt.cli.main import COMMANDS, app

    path, sentinel = pickle_store
    commands = [["verify", str(path)]]
    if "ls" in COMMANDS:
        commands += [["ls", str(path)], ["ls", f"{path}:1"], ["show", f"{path}:1", "model/w"],
                     ["diff", f"{path}:0", f"{path}:1"], ["history", str(path), "model/w"]]
    runner = CliRunner()
    for cmd in commands:
        res = runner.invoke(app, cmd)
        assert res.exit_code in (0, 1, 2), (cmd, res.output)
        assert "Traceback" not in res.output, (cmd, res.output)
        assert not sentinel.exists(), f"dstt {' '.join(cmd)} ran code from the store"
    if os.environ.get("DSTT_CHECK_CONTROL", "1") == "1":
        dstt.open(path).state_dict(1, allow_pickle=True)
        assert sentinel.exists()


# ----------------------------------------------------------------------------- symlinks


def _tree_snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def _store_with_outside(tmp_path: Path) -> tuple[Path, Path, dict[str, Any]]:
    """A store of two steps, and beside it an outside directory holding a
    byte-for-byte copy of one array's chunks (a link there would read fine)."""
    path = tmp_path / "run"
    w = torch.arange(12.0).reshape(3, 4)
    dstt.save(path, 0, {"model": {"w": w}})
    dstt.save(path, 1, {"model": {"w": w + 1}})
    entry = dstt.open(path).record(1).by_name["model/w"]
    outside = tmp_path / "outside"
    outside.mkdir()
    for f in (path / entry.array).iterdir():
        (outside / f.name).write_bytes(f.read_bytes())
    return path, outside, {"array": entry.array, "w": w}


def test_a_symlinked_directory_is_refused_for_reads_and_writes(tmp_path: Path) -> None:
    path, outside, info = _store_with_outside(tmp_path)
    array_dir = path / info["array"]
    for f in array_dir.iterdir():
        f.unlink()
    array_dir.rmdir()
    array_dir.symlink_to(outside, target_is_directory=True)  # identical bytes, but outside the store
    before = _tree_snapshot(outside)
    run = dstt.open(path)
    with pytest.raises(CorruptStoreError, match="symbolic link"):
        run.read("model/w", 1)
    report = verify(path)
    assert not report.ok and any("symbolic link" in str(p) for p in report.problems)
    # Appending a changed step would write a chunk into that directory: refused.
    with pytest.raises(DsttError):
        dstt.save(path, 2, {"model": {"w": info["w"] + 2}})
    assert _tree_snapshot(outside) == before
    assert dstt.open(path).steps() == [0, 1]


def test_a_symlinked_file_is_never_followed(tmp_path: Path) -> None:
    path, outside, info = _store_with_outside(tmp_path)
    entry = dstt.open(path).record(1).by_name["model/w"]
    chunk = path / L.chunk_key(entry.array, entry.slots[0], entry.coords(0))
    chunk.unlink()
    chunk.symlink_to(outside / chunk.name)  # the same bytes, reached through a link
    with pytest.raises(CorruptStoreError, match="symbolic link"):
        dstt.open(path).read("model/w", 1)
    # The next step's chunk key, planted as a link to a file outside: the
    # writer must not truncate or write through it.
    victim = outside / "victim"
    victim.write_bytes(b"keep me")
    record = dstt.open(path).record(1)
    next_slot = record.commit["seq"] + 1  # branch id 0: slot = seq
    planted = path / L.chunk_key(entry.array, next_slot, entry.coords(0))
    planted.symlink_to(victim)
    with pytest.raises(DsttError, match="symbolic link"):
        dstt.save(path, 2, {"model": {"w": info["w"] + 2}})
    assert victim.read_bytes() == b"keep me"
    assert dstt.open(path).steps() == [0, 1]
