"""Bad input: each case raises a specific dstt exception (subclassing the
nearest builtin) whose message names what was wrong, and loses nothing."""

from __future__ import annotations

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
    for c in classes:
        assert issubclass(c, dstt.DsttError)
        if c is not dstt.DsttError:
            assert any(b.__module__ == "builtins" and b is not object for b in c.__mro__[1:]), c
