"""snapshot() stall at scale (issue 16): a step laid out as the previous one
reuses its plan (plan.py _StepMemo, tree.flatten's memo) and is staged in
groups of one pool block each. Reuse must never change what is stored: a
tensor changed in place (shape, strides, storage, dtype, sign bit) or
replaced is planned afresh, captures stay bit-exact, names are checked."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

import dstt
from dstt.errors import InvalidNameError, UnsupportedValueError
from dstt.store.plan import plan_step
from dstt.store.tree import flatten


def _summary(plan: Any) -> list[Any]:
    """What a plan's tasks read (memory, view, dtype, sign) and where they go."""
    return [(t.layout.name, t.layout.sig, t.index, t.coords, t.offset, t.shape, t.source.data_ptr(),
             tuple(t.source.shape), tuple(t.source.stride()), t.source.dtype, t.source.is_neg(),
             t.source.is_conj()) for t in plan.tasks] + \
        [("meta", m.name) for m in plan.meta_arrays] + [(lay.name, lay.array) for lay in plan.layouts]


def test_an_unchanged_step_gets_the_previous_plan_back() -> None:
    """Same tensors (or new objects viewing the same memory alike, as
    model.state_dict() gives each call): the same task list; a tensor
    replaced by another of the same shape: planned afresh, reading it."""
    cache: dict[Any, Any] = {}
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    state: dict[str, Any] = {"m": model.state_dict(), "x": {f"t{i}": torch.randn(3) for i in range(20)}}
    first = plan_step(0, state, layout_cache=cache)
    again = plan_step(1, {"m": model.state_dict(), "x": state["x"]}, layout_cache=cache)
    assert again.tasks is first.tasks and again.layouts is first.layouts and again.step == 1
    assert again.tree == first.tree
    state["x"]["t3"] = torch.randn(3)  # replaced: same name, shape and dtype, other memory
    third = plan_step(2, state, layout_cache=cache)
    assert third.tasks is not first.tasks
    assert _summary(third) == _summary(plan_step(2, state))
    src = next(t.source for t in third.tasks if t.layout.name == "x/t3")
    assert src.data_ptr() == state["x"]["t3"].data_ptr()


def _changes() -> list[tuple[str, Any]]:
    """In-place changes of one state tensor ``s["x"]`` that keep its name
    (and mostly its object) but change what it views or how."""
    def data_other_shape(s: dict[str, Any]) -> None:
        s["x"].data = torch.randn(6, 2)

    def data_same_shape(s: dict[str, Any]) -> None:
        s["x"].data = torch.randn(3, 4)

    def transpose(s: dict[str, Any]) -> None:
        s["x"].t_()

    def set_storage(s: dict[str, Any]) -> None:
        s["x"].set_(torch.randn(12).untyped_storage(), 0, (3, 4), (4, 1))

    def strided_alike(s: dict[str, Any]) -> None:
        s["x"].as_strided_((3, 4), (1, 3))  # same storage, offset and sizes; other strides

    def resize(s: dict[str, Any]) -> None:
        s["x"].resize_(2, 4)

    def unsqueeze(s: dict[str, Any]) -> None:
        s["x"].unsqueeze_(0)

    def dtype_view(s: dict[str, Any]) -> None:
        s["x"] = s["x"].view(torch.int32)  # same memory, sizes and strides; other dtype

    def negative_view(s: dict[str, Any]) -> None:
        z = s["z"]
        s["x"] = z.conj().imag  # the same memory as z.imag, read negated

    def offset(s: dict[str, Any]) -> None:
        s["x"] = s["big"][1:4]

    return [(f.__name__, f) for f in (data_other_shape, data_same_shape, transpose, set_storage, strided_alike,
                                      resize, unsqueeze, dtype_view, negative_view, offset)]


def _state(change: str) -> dict[str, Any]:
    torch.manual_seed(1)
    z = torch.randn(3, 4, dtype=torch.complex64)
    big = torch.randn(6, 4)
    x = z.imag if change == "negative_view" else big[0:3] if change == "offset" else torch.randn(3, 4)
    return {"x": x, "z": z, "big": big, "n": {f"k{i}": torch.full((5,), float(i)) for i in range(30)}}


@pytest.mark.parametrize("change", [name for name, _ in _changes()])
def test_a_tensor_changed_in_place_is_planned_afresh(change: str) -> None:
    """After each change the reused plan is exactly the plan made from
    scratch (its sources view what the live tensor views, as it does)."""
    fn = dict(_changes())[change]
    cache: dict[Any, Any] = {}
    state = _state(change)
    plans = [plan_step(0, state, layout_cache=cache)]
    plans.append(plan_step(1, state, layout_cache=cache))
    assert plans[1].tasks is plans[0].tasks
    fn(state)
    changed = plan_step(2, state, layout_cache=cache)
    assert changed.tasks is not plans[0].tasks
    assert _summary(changed) == _summary(plan_step(2, state)), change
    src = next(t.source for t in changed.tasks if t.layout.name == "x")
    assert torch.equal(src, state["x"]) and src.is_neg() == state["x"].is_neg()
    later = plan_step(3, state, layout_cache=cache)
    assert _summary(later) == _summary(changed)
    if change != "negative_view":  # (a state holding a negative view is compared tensor by tensor)
        assert later.tasks is changed.tasks  # and reused from then on


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.resolve_neg().resolve_conj().contiguous()
    return t.reshape(-1).view(torch.uint8).clone()


def test_capture_is_bit_exact_through_in_place_layout_changes(tmp_path: Path) -> None:
    """One Capture, one change per step (and unchanged steps between):
    every step stored holds what the state held at its snapshot()."""
    state = _state("negative_view")
    state["x"] = torch.randn(3, 4)
    path = tmp_path / "run"
    expected: dict[int, dict[str, tuple[torch.dtype, torch.Tensor]]] = {}
    changes = [fn for _, fn in _changes() if _ not in ("negative_view", "offset")]
    with dstt.Capture(path, max_chunk_bytes=64) as cap:
        for step in range(2 * len(changes) + 1):
            if step % 2:
                changes[step // 2](state)
            for v in list(state["n"].values())[::5]:
                v.add_(1)
            cap.snapshot(step, extra=state, rng=False)
            expected[step] = {"x": (state["x"].dtype, _bits(state["x"])), "big": (torch.float32, _bits(state["big"])),
                              "n/k5": (torch.float32, _bits(state["n"]["k5"]))}
            cap.wait()
    run = dstt.open(path)
    assert run.steps() == sorted(expected)
    for step, want in expected.items():
        for name, (dtype, bits) in want.items():
            got = run.read(f"extra/{name}", step)
            assert got.dtype == dtype and torch.equal(_bits(got), bits), (step, name)


def _random_state(rng: random.Random, pool: list[torch.Tensor]) -> Any:
    """A nested state of dicts (string keys, some needing escapes), lists
    and scalars, with tensors drawn from ``pool`` (so steps share them)."""
    def node(depth: int) -> Any:
        r = rng.random()
        if depth > 2 or r < 0.4:
            return rng.choice(pool) if rng.random() < 0.8 else rng.choice([1, 2.5, "s", None])
        if r < 0.9:
            keys = rng.sample(["a", "b", "c/d", "e%f", "g", "1"], rng.randint(0, 4))
            return {k: node(depth + 1) for k in keys}
        return [node(depth + 1) for _ in range(rng.randint(0, 3))]
    return {"root": node(0), "more": node(0)}


def test_flatten_with_a_memo_equals_flatten_without() -> None:
    """Over random nested states flattened one after another through one
    memo: the same tree, names, tensors (objects) and kinds as without."""
    rng = random.Random(5)
    pool = [torch.zeros(2), torch.ones(3), torch.arange(4)]
    memo: dict[str, Any] = {}
    states = [_random_state(rng, pool) for _ in range(300)]
    for state in states + states[::-1]:
        got, want = flatten(state, memo=memo), flatten(state)
        assert got[0] == want[0] and got[2] == want[2]
        assert list(got[1]) == list(want[1]) and all(got[1][k] is want[1][k] for k in want[1])


def test_flatten_memo_keeps_refusing_what_flatten_refuses() -> None:
    """Two tensors mapping to one name and a cycle are refused with the
    memo too, every time, and a refused call leaves the memo as it was."""
    memo: dict[str, Any] = {}
    t = torch.zeros(2)
    ok = {"a": {"x": t, "y": t}}
    flatten(ok, memo=memo)
    before = dict(memo["dicts"])
    clash: dict[Any, Any] = {1: {"x": t}, "1": {"x": t}}
    cyclic: dict[str, Any] = {"a": {"x": t}}
    cyclic["a"]["self"] = cyclic
    for _ in range(2):
        with pytest.raises(InvalidNameError, match="two tensors map to the name '1/x'"):
            flatten(clash, memo=memo)
        with pytest.raises(UnsupportedValueError, match="reference cycle"):
            flatten(cyclic, memo=memo)
        assert memo["dicts"] == before


def test_bad_name_refused_at_every_step_after_reused_steps(tmp_path: Path) -> None:
    """Steps reused from the plan of the previous one, then a name no store
    can hold: refused at snapshot() each time, the good steps stored."""
    state: dict[str, Any] = {f"t{i}": torch.full((4,), float(i)) for i in range(10)}
    path = tmp_path / "run"
    with dstt.Capture(path) as cap:
        for step in range(3):
            cap.snapshot(step, extra=state, rng=False)
        state["x" * 300] = torch.ones(2)
        for step in range(3, 5):
            with pytest.raises(InvalidNameError, match="at most 255"):
                cap.snapshot(step, extra=state, rng=False)
        del state["x" * 300]
        cap.snapshot(5, extra=state, rng=False)
    run = dstt.open(path)
    assert run.steps() == [0, 1, 2, 5]
    assert torch.equal(run.read("extra/t7", 5), state["t7"])


def _mixed_state() -> dict[str, Any]:
    """Small tensors of several dtypes and shapes (1-D, 2-D, 0-d, strided,
    bool, bfloat16, complex), a large one, and one requiring grad."""
    torch.manual_seed(2)
    state: dict[str, Any] = {f"f{i:03d}": torch.randn(16) for i in range(60)}
    state.update({f"m{i:02d}": torch.randn(3, 5) for i in range(10)})
    state.update({f"s{i}": torch.tensor(float(i)) for i in range(5)})
    state.update({f"h{i:02d}": torch.randn(8).to(torch.bfloat16) for i in range(10)})
    state["strided"] = torch.randn(6, 4).t()
    state["mask"] = torch.rand(33) > 0.5
    state["z"] = torch.randn(7, dtype=torch.complex64)
    state["big"] = torch.randn(300, 300)
    state["p"] = torch.nn.Parameter(torch.randn(4))
    return state


@pytest.mark.parametrize("helper", [None, False], ids=["helper", "in-process"])
def test_grouped_staging_stores_every_step_bit_exact(tmp_path: Path, helper: bool | None) -> None:
    """Steps staged in groups (one block and one copy per group; the views
    made by the stager with the helper), the plan reused between layout
    changes: every step holds what the state held at its snapshot()."""
    state = _mixed_state()
    path = tmp_path / "run"
    expected: dict[int, dict[str, torch.Tensor]] = {}
    with dstt.Capture(path, helper=helper) as cap:
        for step in range(6):
            if step == 3:
                state["f010"] = torch.randn(2, 2)  # a layout change: planned and grouped afresh
            with torch.no_grad():
                for v in list(state.values())[::4]:
                    if v.dtype != torch.bool:
                        v.add_(1)
            cap.snapshot(step, extra=state, rng=False)
            expected[step] = {k: _bits(v.detach()) for k, v in state.items()}
            cap.wait()
        assert cap.pool is not None and cap.pool.in_use == 0
    run = dstt.open(path)
    for step, want in expected.items():
        got = run.state_dict(step)["extra"]
        assert got.keys() == want.keys()
        for k, bits in want.items():
            assert got[k].dtype == state[k].dtype and torch.equal(_bits(got[k]), bits), (step, k)


def test_a_failed_group_copy_fails_the_step_and_returns_its_blocks(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy into a group's block that raises (after other groups were
    staged): the step fails, every block of it goes back to the pool, and
    the next step is stored."""
    state: dict[str, Any] = {f"t{i:04d}": torch.full((1024,), float(i)) for i in range(600)}  # 2.4 MB: 3 groups
    path = tmp_path / "run"
    real_cat, calls = torch.cat, [0]

    def cat_failing_third(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected copy failure")
        return real_cat(*args, **kwargs)

    with dstt.Capture(path) as cap:
        cap.snapshot(0, extra=state, rng=False)
        cap.wait()
        monkeypatch.setattr(torch, "cat", cat_failing_third)
        cap.snapshot(1, extra=state, rng=False)
        monkeypatch.setattr(torch, "cat", real_cat)
        assert calls[0] == 3
        with pytest.raises(dstt.CaptureError, match="injected copy failure"):
            cap.wait()
        assert cap.pool is not None and cap.pool.in_use == 0
        state["t0005"].add_(1)
        cap.snapshot(2, extra=state, rng=False)
        cap.wait()
        assert cap.pool.in_use == 0
    run = dstt.open(path)
    assert run.steps() == [0, 2]
    assert torch.equal(run.read("extra/t0005", 2), state["t0005"])


def test_lazy_split_follows_the_optimizer_and_stays_bit_exact(tmp_path: Path) -> None:
    """The eager/lazy split kept between steps of one layout is made again
    when the optimizer's parameters change (a group added): the added
    parameters are copied lazily from then on, every step bit-exact."""
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    path = tmp_path / "run"
    expected: dict[int, dict[str, torch.Tensor]] = {}
    with dstt.Capture(path) as cap:
        for step in range(6):
            if step == 3:
                opt.add_param_group({"params": model[1].parameters()})
            opt.zero_grad()
            model(torch.randn(4, 6)).square().mean().backward()
            opt.step()
            cap.snapshot(step, model=model, optimizer=opt, rng=False)
            expected[step] = {k: _bits(v) for k, v in model.state_dict().items()}
            lazy = set(cap.parts.lazy_split.names)
            assert ("model/1.weight" in lazy) == (step >= 3), step
        cap.wait()
    run = dstt.open(path)
    for step, want in expected.items():
        got = run.state_dict(step)["model"]
        assert all(torch.equal(_bits(got[k]), bits) for k, bits in want.items()), step


def test_guard_range_check_names_the_changed_tensor() -> None:
    """VersionGuard.copied_range (one check per run of lazy copies) finds a
    change anywhere in the run, names that tensor, and skips inference
    tensors (no version counter) as copied() does."""
    from dstt.capture.guard import VersionGuard

    with torch.inference_mode():
        frozen = torch.zeros(2)
    sources = [torch.zeros(2) for _ in range(5)] + [frozen]
    guard = VersionGuard(sources, [f"t{i}" for i in range(6)])
    assert guard.copied_range(0, 6) is None
    again = VersionGuard(sources, [f"t{i}" for i in range(6)])
    sources[3].add_(1)
    assert again.copied_range(0, 2) is None
    violation = again.copied_range(2, 6)
    assert violation is not None and "'t3'" in violation
