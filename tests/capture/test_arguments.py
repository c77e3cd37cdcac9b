"""Issue 23 (11, 13): every public argument is refused up front, and a
refused call changes nothing.

Table-driven: for every public entry point -- ``Capture``/``CaptureConfig``,
``save``, ``Writer``, ``Capture.snapshot``/``rewind``/``incident``,
``break_lock``/``dstt unlock`` -- bad values of each argument, the dstt
exception each must raise, and a check that the store's files (every
byte), the live model and optimizer and the recorded incidents are as they
were. Before the fix: ``parent=("main", 1.5)`` forked silently at step 1,
``("main", None)`` and ``zstd_level="x"`` raised raw TypeErrors,
``zstd_level=1.5`` and ``allow_pickle="no"`` were accepted,
``incident(step=999)`` recorded an incident for a step never captured, a
refused ``rewind(999)`` recorded an incident and dumped the memory tier,
and ``rewind(step, branch=<the current branch>)`` was accepted (with
``memory_steps``: the next snapshot raised StoreLockedError naming the
trainer itself) or refused only after the live model was restored.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import dstt
from dstt.errors import (
    BranchExistsError,
    ConfigError,
    DsttError,
    InvalidNameError,
    InvalidReferenceError,
    StepNotFoundError,
    StepOrderError,
)
from dstt.format.backends import open_backend
from dstt.format.incidents import list_incidents
from dstt.format.lock import break_lock
from dstt.format.writeoptions import WriteOptions
from dstt.store.writer import Writer


def _files(root: Path) -> dict[str, bytes]:
    """Every file of the store and its bytes."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            out[str(p.relative_to(root))] = p.read_bytes()
    return out


@pytest.fixture(scope="module")
def store_made_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store with steps 0..2 on main and a second branch, saved once per
    module (four synced saves per case were most of this module's time)."""
    path = tmp_path_factory.mktemp("arguments") / "run"
    for s in range(3):
        dstt.save(path, s, {"w": torch.full((4,), float(s))})
    dstt.save(path, 5, {"w": torch.zeros(4)}, branch="side", parent=("main", 1))
    return path


@pytest.fixture
def store(store_made_once: Path, tmp_path: Path) -> Path:
    """A copy of that store of this test's own: what a refused call might
    change is compared with it, and no case sees another's changes."""
    path = tmp_path / "run"
    shutil.copytree(store_made_once, path, symlinks=True)
    return path


STEPS = [1.5, -1, "3", True, None, 10**21, 5.0]
PARENTS = [("main", "5"), ("main", 5.0), ("main", 1.5), ("main", None), ("main", -1), ("main",), ("../x", 1),
           (None, 1), 5, b"main:1", "elsewhere/run:1:2", ("main", 1, 2)]
PARENT_ERRORS = (StepOrderError, InvalidNameError, InvalidReferenceError)

#: (option, bad values, the exception) for CaptureConfig / Capture(**options).
CAPTURE_OPTIONS: list[tuple[str, list[Any], type[DsttError] | tuple[type[DsttError], ...]]] = [
    ("every", [0, 1.0, True, "1", -2], ConfigError),
    ("branch", ["", "../x", 5, "a b", None], InvalidNameError),
    ("parent", PARENTS, PARENT_ERRORS),
    ("host_buffer_bytes", [1.5e9, 0, "1", True], ConfigError),
    ("on_full", ["drop", None, 1], ConfigError),
    ("compression", ["bogus", 3, ""], ConfigError),  # (None: the default, predictive where the helper runs)
    ("zstd_level", ["x", 1.5, 99, -8, True, None], ConfigError),
    ("keyframe_every", [0, 2.0, "8"], ConfigError),
    ("max_chunk_bytes", [0, "64", 1.5], ConfigError),
    ("flush_threads", [0, 1.5, "2"], ConfigError),
    ("encode_threads", [0, 1.5, "2"], ConfigError),
    ("allow_pickle", ["no", 1, None], ConfigError),
    ("dedup", ["x", 0], ConfigError),
    ("background_nice", [20, -1, 1.5, True], ConfigError),
    ("background_idle", [1, "yes"], ConfigError),
    ("exit_drain_s", [-1, math.inf, math.nan, "5", 10**400], ConfigError),
    ("shm", ["yes", 1], ConfigError),
    ("helper", [1, "auto"], ConfigError),
    ("storage_options", ["x", {1: 2}, [("a", 1)]], ConfigError),
    ("memory_steps", [0, 1.5, 2000, "4", True], ConfigError),
    ("persist", [2.0, "some", 0, True], ConfigError),
    ("watch_nonfinite", ["x", 1], ConfigError),
    ("background_timeout_s", [0, -1, math.inf, "3", None], ConfigError),
    ("no_such_option", [1], ConfigError),
]

#: (argument, bad values, the exception) for Writer(store, **kw); save takes the common ones.
WRITER_ARGS: list[tuple[str, list[Any], type[DsttError] | tuple[type[DsttError], ...]]] = [
    ("branch", ["", "../x", 5], InvalidNameError),
    ("parent", PARENTS, PARENT_ERRORS),
    ("compression", ["bogus", None, 3], ConfigError),
    ("zstd_level", ["x", 1.5, 99, True], ConfigError),
    ("keyframe_every", [0, 2.0], ConfigError),
    ("max_chunk_bytes", [0, "64", 1.5], ConfigError),
    ("threads", [0, 1.5], ConfigError),
    ("allow_pickle", ["no", 1], ConfigError),
    ("dedup", ["x"], ConfigError),
    ("storage_options", ["x", {1: 2}], ConfigError),
    ("pack_chunk_bytes", [-1, 1.5, "1"], ConfigError),
]
SAVE_ARGS = [a for a in WRITER_ARGS if a[0] in ("branch", "parent", "compression", "keyframe_every",
                                                "allow_pickle", "storage_options")]


def _id(text: str, width: int) -> str:
    """A test id that is the same in every process (no object addresses: pytest-xdist's workers must agree)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)[:width]


def _cases(table: list[tuple[str, list[Any], Any]]) -> list[Any]:
    return [pytest.param(name, v, exc, id=_id(f"{name}={v!r}", 60)) for name, values, exc in table for v in values]


@pytest.mark.parametrize("name, value, exc", _cases(CAPTURE_OPTIONS))
def test_capture_options_are_refused_up_front(store: Path, name: str, value: Any, exc: Any) -> None:
    before = _files(store)
    opts = {name: value}
    if name in ("persist", "watch_nonfinite") and value is not True:
        opts["memory_steps"] = 2
        opts["helper"] = False
    with pytest.raises(exc):
        dstt.CaptureConfig(**opts) if name != "no_such_option" else dstt.Capture(store, **opts)
    with pytest.raises(exc) as info:
        dstt.Capture(store, **{"branch": "new", **opts})
    assert "\n" not in str(info.value)  # one line
    assert _files(store) == before


@pytest.mark.parametrize("name, value, exc", _cases(WRITER_ARGS))
def test_writer_arguments_are_refused_up_front(store: Path, name: str, value: Any, exc: Any) -> None:
    before = _files(store)
    kwargs = {"branch": "new", name: value}
    with pytest.raises(exc) as info:
        Writer(store, WriteOptions(**kwargs))  # (refused by WriteOptions: checked once, before any Writer)
    assert "\n" not in str(info.value)
    assert _files(store) == before


def test_writer_takes_write_options_only(store: Path) -> None:
    """Writer's options are one WriteOptions: anything else is refused before
    the store is touched (its fields are not checked again by the Writer)."""
    before = _files(store)
    with pytest.raises(ConfigError, match="options must be a WriteOptions, got dict"):
        Writer(store, {"branch": "new"})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Writer(store, branch="new")  # type: ignore[call-arg]
    assert _files(store) == before


@pytest.mark.parametrize("name, value, exc", _cases([*SAVE_ARGS, ("step", STEPS, StepOrderError)]))
def test_save_arguments_are_refused_up_front(store: Path, name: str, value: Any, exc: Any) -> None:
    before = _files(store)
    kwargs: dict[str, Any] = {"branch": "new", name: value}
    step = kwargs.pop("step", 9)
    with pytest.raises(exc):
        dstt.save(store, step, {"w": torch.ones(4)}, **kwargs)
    assert _files(store) == before
    assert dstt.open(store).branches() == ["main", "side"]


def test_a_parent_step_is_never_converted(store: Path) -> None:
    """("main", 1.5) used to fork at step 1 (int(1.5)) in Capture."""
    with pytest.raises(StepOrderError, match="parent step must be an integer"):
        dstt.Capture(store, branch="b", parent=("main", 1.5))
    with dstt.Capture(store, branch="b", parent=["main", 2]) as cap:  # a list is a pair too
        cap.snapshot(7, extra={"x": 1}, rng=False)
    assert dstt.open(store).branch_info("b").parent == ("main", 2)


def test_break_lock_and_unlock_arguments(store: Path) -> None:
    before = _files(store)
    for bad, exc in [("../x", InvalidNameError), (5, InvalidNameError)]:
        with pytest.raises(exc):
            break_lock(store, bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        break_lock(store, "main", force="yes")  # type: ignore[arg-type]
    runner = CliRunner()
    from dstt.cli.main import app

    for ref in (f"{store}@../x", f"{store}", f"{store}@main:1", f"{store}@nope"):
        r = runner.invoke(app, ["unlock", ref])
        assert r.exit_code in (1, 2) and "Traceback" not in r.output, (ref, r.output)
    assert _files(store) == before


# --------------------------------------------------------------------- the trainer's calls on a Capture


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    return m, torch.optim.Adam(m.parameters(), lr=0.1)


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def _live(m: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [v.detach().clone() for v in m.state_dict().values()]
    for st in opt.state.values():
        out += [v.clone() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x.view(-1), y.view(-1)) for x, y in zip(a, b))


#: (call, bad arguments, the exception). "cur" stands for the branch being
#: captured, "side" for another existing branch, m/opt for the live objects.
TRAINER_CALLS: list[tuple[str, dict[str, Any], Any]] = [
    *[("snapshot", {"step": v}, StepOrderError) for v in (1.5, -1, "9", True, None)],
    ("snapshot", {"step": 9, "rng": "yes"}, ConfigError),
    ("snapshot", {"step": 9, "model": "m"}, ConfigError),
    ("snapshot", {"step": 9, "optimizer": 5}, ConfigError),
    ("snapshot", {"step": 9, "scheduler": 5}, ConfigError),
    *[("rewind", {"step": v}, StepOrderError) for v in (1.5, -1, "3", True, None)],
    ("rewind", {"step": 999}, StepNotFoundError),  # never captured
    ("rewind", {"step": 4, "branch": "cur"}, BranchExistsError),  # issue 23 (11)
    ("rewind", {"step": 4, "branch": "side"}, BranchExistsError),
    ("rewind", {"step": 4, "branch": "../x"}, InvalidNameError),
    ("rewind", {"step": 4, "branch": 5}, InvalidNameError),
    ("rewind", {"step": 4, "rng": "x"}, ConfigError),
    ("rewind", {"step": 4, "strict": 1}, ConfigError),
    ("rewind", {"step": 4, "model": "m"}, ConfigError),
    ("rewind", {"step": 4, "optimizer": 5}, ConfigError),
    ("rewind", {"step": 4, "scheduler": object()}, ConfigError),
    ("rewind", {"step": 4, "model": torch.nn.Linear(3, 3), "optimizer": None}, dstt.RestoreMismatchError),
    ("rewind", {"step": 4, "model": torch.nn.Linear(4, 3)}, InvalidNameError),  # the optimizer is not its own
    *[("incident", {"reason": v}, ConfigError) for v in ("", "   ", 5, None)],
    *[("incident", {"reason": "r", "step": v}, StepOrderError) for v in (1.5, -1, "3", True)],
    ("incident", {"reason": "r", "step": 999}, StepNotFoundError),  # never captured
    ("incident", {"reason": "r", "step": 0}, StepNotFoundError),  # captured on another branch only
]


def _trainer_cases() -> list[Any]:
    """Every call in both modes; snapshot's arguments are refused before the
    step reaches the memory tier (validate_step, state_of: the same path in
    both modes), so with the tier one snapshot case stays quick and the rest
    run under -m slow."""
    out = []
    for memory_steps, mode in ((None, "store"), (4, "memory-tier")):
        for i, (c, a, e) in enumerate(TRAINER_CALLS):
            slow = memory_steps is not None and c == "snapshot" and i > 0
            out.append(pytest.param(memory_steps, c, a, e, id=f"{_id(f'{c}-{a}', 70)}-{mode}",
                                    marks=[pytest.mark.slow] if slow else []))
    return out


@pytest.mark.parametrize("memory_steps, call, args, exc", _trainer_cases())
def test_trainer_calls_are_refused_before_anything_changes(tmp_path: Path, memory_steps: int | None, call: str,
                                                           args: dict[str, Any], exc: Any) -> None:
    """A refused call leaves the store (every byte, no incident), the memory
    tier (no step dumped) and the live model and optimizer as they were;
    capture then goes on, on the same branch."""
    path = tmp_path / "run"
    dstt.save(path, 0, {"w": torch.ones(2)}, branch="side")
    m, opt = _model()
    extra = {"persist": 2} if memory_steps else {}
    with dstt.Capture(path, memory_steps=memory_steps, helper=False, **extra) as cap:
        for s in range(2, 7):  # with persist=2: 2, 4, 6 stored; 3, 5 in memory only
            _train(m, opt)
            cap.snapshot(s, model=m, optimizer=opt, extra={"s": s})
        cap.wait()
        before, live = _files(path), _live(m, opt)
        kwargs = dict(args)
        if kwargs.get("branch") == "cur":
            kwargs["branch"] = cap.writer.branch.name
        if call in ("snapshot", "rewind"):
            kwargs = {"model": m, "optimizer": opt, **kwargs}
        with pytest.raises(exc) as info:
            first = kwargs.pop("reason" if call == "incident" else "step")
            getattr(cap, call)(first, **kwargs)
        assert "\n" not in str(info.value)
        cap.wait()
        assert _files(path) == before, "the store changed"
        assert list_incidents(open_backend(path)) == []
        assert _same(_live(m, opt), live), "the live objects changed"
        _train(m, opt)
        cap.snapshot(7, model=m, optimizer=opt)  # capture goes on, on the same branch
        assert cap.writer.branch.name == "main"
    run = dstt.open(path)
    assert run.steps("main")[-1] == 7 and run.branches() == ["main", "side"]


@pytest.mark.parametrize("memory_steps", [None, 4], ids=["store", "memory-tier"])
def test_a_rewind_to_the_current_branch_is_refused_and_a_new_one_works(tmp_path: Path,
                                                                       memory_steps: int | None) -> None:
    """Issue 23 (11): the same rule in both modes -- a rewind continues on a
    new branch (docs/flight-recorder.md "Rewind"); a refused one changes
    nothing, and the next rewind and the steps after it behave."""
    path = tmp_path / "run"
    m, opt = _model()
    ref = {}
    extra = {"persist": "all"} if memory_steps else {}
    with dstt.Capture(path, memory_steps=memory_steps, helper=False, **extra) as cap:
        for s in range(5):
            _train(m, opt)
            cap.snapshot(s, model=m, optimizer=opt, extra={"s": s})
            ref[s] = _live(m, opt)
        cap.wait()
        live = _live(m, opt)
        with pytest.raises(BranchExistsError, match="'main' is the branch being captured"):
            cap.rewind(2, model=m, optimizer=opt, branch="main")
        assert _same(_live(m, opt), live)
        assert cap.rewind(2, model=m, optimizer=opt, branch="retry") == {"s": 2}
        assert _same(_live(m, opt), ref[2])
        with pytest.raises(BranchExistsError, match="'retry' is the branch being captured"):
            cap.rewind(2, model=m, optimizer=opt, branch="retry")  # (retry is current now, fork pending or not)
        _train(m, opt)
        cap.snapshot(3, model=m, optimizer=opt)
        assert cap.writer.branch.name == "retry"
    run = dstt.open(path)
    assert run.steps("main") == [0, 1, 2, 3, 4]
    assert run.steps("retry") == [3] and run.branch_info("retry").parent == ("main", 2)
    assert dstt.verify(path).ok
