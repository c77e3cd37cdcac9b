"""Bad input: each case raises a specific dstt exception (subclassing the
nearest builtin) whose message names what was wrong, and loses nothing."""

from __future__ import annotations

import enum
from pathlib import Path

import pytest
import torch

import dstt


@pytest.fixture
def saved(store: Path) -> Path:
    dstt.save(store, 0, {"model": {"layer.weight": torch.ones(2)}})
    dstt.save(store, 1, {"model": {"layer.weight": torch.zeros(2)}})
    return store


def test_missing_store(tmp_path: Path) -> None:
    with pytest.raises(dstt.StoreNotFoundError, match="does not exist") as e:
        dstt.open(tmp_path / "nope")
    assert isinstance(e.value, FileNotFoundError)


def test_directory_that_is_not_a_store(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(dstt.NotADsttStoreError, match="not a dstt store"):
        dstt.open(tmp_path)
    with pytest.raises(dstt.NotADsttStoreError, match="refusing to write"):
        dstt.save(tmp_path, 0, {"w": torch.ones(1)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_zarr_group_that_is_not_dstt(tmp_path: Path) -> None:
    import zarr

    zarr.open_group(tmp_path / "z", mode="w")
    with pytest.raises(dstt.NotADsttStoreError, match="not a dstt store"):
        dstt.open(tmp_path / "z")


def test_unknown_branch_step_tensor(saved: Path) -> None:
    run = dstt.open(saved)
    with pytest.raises(dstt.BranchNotFoundError, match="no branch 'dev'.*branches: main") as e:
        run.steps("dev")
    assert isinstance(e.value, KeyError)
    with pytest.raises(dstt.BranchNotFoundError):
        dstt.open(f"{saved}@dev")
    with pytest.raises(dstt.StepNotFoundError, match="no committed step 7 on branch 'main' .*0..1"):
        run.read("model/layer.weight", 7)
    with pytest.raises(dstt.TensorNotFoundError, match="did you mean 'model/layer.weight'"):
        run.read("model/layer.weigth", 1)
    with pytest.raises(dstt.StepNotFoundError, match="~5 goes before the first step"):
        dstt.open(f"{saved}:~5").state_dict()


def test_invalid_names(store: Path) -> None:
    with pytest.raises(dstt.InvalidNameError, match="invalid branch name '../x'"):
        dstt.save(store, 0, {"w": torch.ones(1)}, branch="../x")
    with pytest.raises(dstt.InvalidNameError, match="two tensors map to the name 'a/1'"):
        dstt.save(store, 0, {"a": {1: torch.ones(1), "1": torch.zeros(1)}})
    with pytest.raises(dstt.InvalidReferenceError, match="bad step 'abc'"):
        dstt.open(f"{store}:abc")


def test_duplicate_step_refused_and_data_untouched(saved: Path) -> None:
    with pytest.raises(dstt.StepExistsError, match="step 1 already exists on branch 'main'") as e:
        dstt.save(saved, 1, {"model": {"layer.weight": torch.full((2,), 9.0)}})
    assert isinstance(e.value, FileExistsError)
    assert torch.equal(dstt.open(saved).read("model/layer.weight", 1), torch.zeros(2))


def test_a_forked_branch_refuses_the_steps_it_inherits(saved: Path) -> None:
    """A branch forked at main:1 reads main's steps 0 and 1 as its own
    (side:1 resolves to main:1); saving side:1 or side:0 used to succeed,
    changing what side:1 reads and sending side's latest step back in time."""
    weight = {"model": {"layer.weight": torch.full((2,), 9.0)}}
    with pytest.raises(dstt.StepExistsError, match="step 1 of branch 'side' is inherited from main:1"):
        dstt.save(saved, 1, weight, branch="side", parent=("main", 1))
    with pytest.raises(dstt.StepOrderError, match="step 0 of branch 'side' is inherited from main:1"):
        dstt.save(saved, 0, weight, branch="side", parent=("main", 1))
    run = dstt.open(saved)
    assert run.steps("side") == [] and torch.equal(run.read("model/layer.weight", 1, branch="side"), torch.zeros(2))
    dstt.save(saved, 2, weight, branch="side", parent=("main", 1))
    assert dstt.open(saved).lineage("side") == [("main", [0, 1]), ("side", [2])]


class Opaque:
    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.x == self.x


def test_unsupported_value_needs_allow_pickle(store: Path) -> None:
    with pytest.raises(dstt.UnsupportedValueError, match="at extra/obj: cannot store a .*Opaque without pickle") as e:
        dstt.save(store, 0, {"extra": {"obj": Opaque(1)}})
    assert isinstance(e.value, TypeError)
    dstt.save(store, 0, {"extra": {"obj": Opaque(1)}}, allow_pickle=True)
    run = dstt.open(store)
    with pytest.raises(dstt.PickleNotAllowedError, match="allow_pickle=True"):
        run.state_dict(0)
    assert run.state_dict(0, allow_pickle=True)["extra"]["obj"] == Opaque(1)
    assert run.commit_info(0)["has_pickle"] is True


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_unsupported_dtype(store: Path) -> None:
    with pytest.raises(dstt.UnsupportedDtypeError, match="cannot store dtype torch.complex32"):
        dstt.save(store, 0, {"q": torch.zeros(2, dtype=torch.complex32)})


def test_bad_slices(saved: Path) -> None:
    run = dstt.open(saved)
    with pytest.raises(dstt.InvalidReferenceError, match="index 5 out of range"):
        run.read("model/layer.weight", 1, index=5)
    with pytest.raises(dstt.InvalidReferenceError, match="index has 2 dimensions"):
        run.read("model/layer.weight", 1, index=(0, 0))


def test_every_error_is_a_dstt_error() -> None:
    import inspect

    import dstt.errors as errors

    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]
    assert len(classes) > 15
    for c in classes:  # every class there is an error or a warning of dstt's, and a builtin's subclass
        assert issubclass(c, dstt.DsttError) != issubclass(c, dstt.DsttWarning), c
        if c not in (dstt.DsttError, dstt.DsttWarning):
            assert any(b.__module__ == "builtins" and b is not object for b in c.__mro__[1:]), c


class Phase(enum.IntEnum):
    TRAIN = 1


def test_values_that_would_change_type_need_pickle(store: Path) -> None:
    """Subclasses of int/str came back as int/str, and numpy arrays of dtypes
    torch lacks raised TypeError/ValueError: refused like any other value."""
    import numpy as np

    bad = {"phase": Phase.TRAIN, "np_str": np.str_("a"), "words": np.array(["a", "b"]),
           "when": np.array([1], dtype="datetime64[s]"), "big_endian": np.arange(3, dtype=">i4"),
           # its .item() is itself, not a Python float: saving it recursed forever
           "longdouble": np.longdouble(1) / 3}
    for key, value in bad.items():
        with pytest.raises(dstt.UnsupportedValueError, match=f"at extra/{key}: cannot store a .* without pickle") as e:
            dstt.save(store, 0, {"extra": {key: value}})
        assert isinstance(e.value, TypeError)
    assert dstt.open(store).steps() == []  # nothing was committed
    dstt.save(store, 0, {"extra": bad}, allow_pickle=True)
    back = dstt.open(store).state_dict(0, allow_pickle=True)["extra"]
    assert back["phase"] is Phase.TRAIN and type(back["np_str"]) is np.str_
    assert back["big_endian"].dtype == np.dtype(">i4") and back["big_endian"].tolist() == [0, 1, 2]
    assert type(back["longdouble"]) is np.longdouble and back["longdouble"] == bad["longdouble"]


@pytest.mark.parametrize("where", ["local", "memory"])
def test_names_no_store_can_hold_are_refused_before_writing(store: Path, where: str) -> None:
    """A lone surrogate raised UnicodeEncodeError; an over-long component
    failed on disk mid-step; and an array path over 4,096 characters was
    committed on memory:// -- then refused by every reader."""
    import uuid

    url = store if where == "local" else f"memory://dstt-names-{uuid.uuid4().hex}"
    dstt.save(url, 0, {"w": torch.ones(1)})
    deep: dict = {}
    leaf = deep
    for _ in range(45):
        leaf = leaf.setdefault("k" * 100, {})
    leaf["w"] = torch.ones(1)
    cases = {"surrogate": ({"m": {"\ud800": torch.ones(1)}}, "not valid Unicode"),
             "long": ({"m": {"x" * 300: torch.ones(1)}}, "at most 255"),
             "deep": (deep, "nested too deeply")}
    for state, message in cases.values():
        with pytest.raises(dstt.InvalidNameError, match=message):
            dstt.save(url, 1, state)
    run = dstt.open(url)
    assert run.steps() == [0]
    assert [k for k in run.backend.list_prefix("tensors") if "/c." in k] == ["tensors/w/@float32_1_c1_raw/c.0.0"]


def test_any_path_save_takes_open_takes(tmp_path: Path) -> None:
    """A store path ending in ':<not a step>' was saved to, then refused by
    dstt.open as a bad reference; a missing one still is a bad reference."""
    for name in ("run:1x", "a@b", "r:c@d"):
        path = tmp_path / name
        dstt.save(path, 0, {"w": torch.ones(1)})
        assert dstt.open(path).steps() == [0] and dstt.open(str(path)).steps() == [0]
    with pytest.raises(dstt.InvalidReferenceError, match="bad step '1x'"):
        dstt.open(tmp_path / "nope:1x")
