"""Issue 25: a step whose only new tensors are the RNG states (and a fresh
``extra`` tensor) reuses the previous step's plan -- the tasks of the new
tensors renewed, every other task the same object -- and every cache keyed
on the step's layout (the eager/lazy split, the copy groups, the seal
record's static part and positions) hits; every step stays bit-exact, and a
late copy of a step's tasks still reads that step's RNG state."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dstt
from dstt.capture import copygroups
from dstt.store import writer as W
from dstt.store.plan import StepPlan, plan_step
from dstt.store.state import state_of

RNG_NAMES = ("rng/torch", "rng/numpy/1", "extra/loss")


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    """One step that draws from torch's, numpy's and Python's generators."""
    opt.zero_grad()
    x = torch.randn(3, 8) + float(np.random.rand()) + random.random()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("helper", [pytest.param(None, marks=pytest.mark.slow), False], ids=["helper", "in-process"])
def test_a_step_with_new_rng_tensors_reuses_the_plan_and_every_cache(tmp_path: Path, helper: bool | None,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])  # 12 parameters, 36 state tensors
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plans: list[StepPlan] = []
    real_plan = W.Writer.plan

    def spy(self: Any, *args: Any, **kwargs: Any) -> StepPlan:
        plan = real_plan(self, *args, **kwargs)
        plans.append(plan)
        return plan

    monkeypatch.setattr(W.Writer, "plan", spy)
    calls: dict[str, int] = {"optimizer_storages": 0, "group_tasks": 0}
    for name in calls:
        real = getattr(copygroups, name)

        def counted(*args: Any, _real: Any = real, _name: str = name) -> Any:
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(copygroups, name, counted)
    expected: dict[int, dict[str, Any]] = {}
    path = tmp_path / "run"
    with dstt.Capture(path, helper=helper) as cap:
        for step in range(6):
            loss = _train_step(model, opt)
            if step == 3:
                calls.update(dict.fromkeys(calls, 0))  # steps 3-5: laid out as step 2
            expected[step] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state()[1].copy(),
                              "python": random.getstate(), "loss": loss.clone(),
                              "model": {k: v.clone() for k, v in model.state_dict().items()}}
            cap.snapshot(step, model=model, optimizer=opt, extra={"loss": loss})
            cap.wait()
    assert calls == {"optimizer_storages": 0, "group_tasks": 0}
    assert len(plans) == 6
    for prev, plan in zip(plans[2:], plans[3:]):
        assert plan.layouts is prev.layouts and plan.meta_arrays is prev.meta_arrays
        assert plan.layout_key is not None and plan.layout_key is prev.layout_key
        renewed = {t.layout.name for t, p in zip(plan.tasks, prev.tasks) if t is not p}
        assert renewed == set(RNG_NAMES), renewed  # every other task: the same object
    run = dstt.open(path)
    assert run.steps() == list(range(6))
    for step, want in expected.items():
        got = run.state_dict(step)
        assert torch.equal(got["rng"]["torch"], want["torch"]), step
        assert np.array_equal(np.asarray(got["rng"]["numpy"][1]), want["numpy"]), step
        assert tuple(got["rng"]["python"][1]) == want["python"][1], step
        assert torch.equal(got["extra"]["loss"], want["loss"]), step
        assert all(torch.equal(got["model"][k], v) for k, v in want["model"].items()), step


def test_a_late_copy_of_a_step_reads_its_own_rng_state() -> None:
    """The plan of step N+1 renews the RNG tasks without touching step N's:
    a copy of step N's tasks made after step N+1 was planned (and the
    generators moved on) holds step N's states, bit for bit."""
    torch.manual_seed(3)
    np.random.seed(3)
    model = torch.nn.Linear(4, 4)
    cache: dict[Any, Any] = {}
    plans, wants = [], []
    for step in range(4):
        torch.randn(7)
        np.random.rand(3)
        wants.append((torch.get_rng_state(), torch.from_numpy(np.random.get_state()[1].copy())))
        plans.append(plan_step(step, state_of(model=model), layout_cache=cache))
    assert plans[3].layout_key is plans[1].layout_key is not None
    for plan, (torch_state, numpy_state) in zip(plans, wants):
        late = {t.layout.name: t.source.clone() for t in plan.tasks}  # copied now, after later steps
        assert torch.equal(late["rng/torch"], torch_state)
        assert torch.equal(late["rng/numpy/1"], numpy_state)
    assert not torch.equal(wants[0][0], wants[1][0])  # (the states did move on)


def test_renewed_tasks_in_groups_alone_and_lazy_stay_bit_exact(tmp_path: Path) -> None:
    """New objects every step where a task is copied in a group (a small
    extra), alone (a large extra) and lazily (an optimizer state tensor
    replaced every other step: the split is made again), with the RNG state:
    every step stored holds what the state held at its snapshot()."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = next(iter(model.parameters()))
    expected: dict[int, dict[str, torch.Tensor]] = {}
    path = tmp_path / "run"
    with dstt.Capture(path, helper=False) as cap:
        for step in range(6):
            _train_step(model, opt)
            if step % 2:
                opt.state[first]["exp_avg"] = opt.state[first]["exp_avg"] * 1.5  # a new lazy tensor
            extra = {"small": torch.randn(16), "big": torch.randn(40_000), "loss": torch.tensor(float(step))}
            cap.snapshot(step, model=model, optimizer=opt, extra=extra)
            expected[step] = {"extra/" + k: v.clone() for k, v in extra.items()}
            expected[step]["rng/torch"] = torch.get_rng_state()
            expected[step]["optim/0.weight/exp_avg"] = opt.state[first]["exp_avg"].clone()
            expected[step].update({"model/" + k: v.clone() for k, v in model.state_dict().items()})
        cap.wait()
    run = dstt.open(path)
    for step, want in expected.items():
        for name, value in want.items():
            assert torch.equal(run.read(name, step), value), (step, name)


def test_guard_scan_in_one_pass_still_finds_and_names_a_change() -> None:
    """VersionGuard.scan (one C-level pass over the pending sources) finds a
    change among many pending ones and names it, ignores sources already
    copied, and with an inference tensor (no version counter) among them
    still checks the others one by one."""
    from dstt.capture.guard import VersionGuard

    with torch.inference_mode():
        frozen = torch.zeros(2)
    for extra in ([], [frozen]):
        sources = [torch.zeros(2) for _ in range(50)] + extra
        guard = VersionGuard(sources, [f"t{i}" for i in range(len(sources))])
        assert guard.scan() is None
        sources[7].add_(1)
        assert guard.copied(7) is not None  # (copied after the change: caught there)
        other = VersionGuard(sources, [f"t{i}" for i in range(len(sources))])
        other.copied(3)
        sources[3].add_(1)  # copied before the change: not the guard's to report
        assert other.scan() is None
        sources[41].add_(1)
        violation = other.scan()
        assert violation is not None and "'t41'" in violation


def test_flatten_memo_of_dicts_of_tensor_dicts_equals_flatten_without() -> None:
    """An optimizer-like state (leading all-tensor dicts by parameter, then
    other values) changed at random between calls through one memo: the
    same tree, names (in order), tensors and kinds as without the memo, and
    a name clash still refused."""
    from dstt.errors import InvalidNameError
    from dstt.store.tree import flatten

    rng = random.Random(7)
    pool = [torch.zeros(2), torch.ones(3), torch.arange(4)]

    def mutate(opt: dict[str, Any]) -> None:
        if not opt:
            opt["p0"] = {"step": rng.choice(pool)}
            return
        keys = list(opt)
        k = rng.choice(keys)
        r = rng.randrange(10)
        if r == 0 and isinstance(opt[k], dict) and opt[k]:
            opt[k][rng.choice(list(opt[k]))] = rng.choice(pool)  # another tensor object
        elif r == 1 and isinstance(opt[k], dict):
            opt[k]["extra"] = rng.choice(pool)  # an inner key added
        elif r == 2:
            opt[k] = rng.choice([1.5, [rng.choice(pool)], rng.choice(pool), {"x": 2}])  # not a tensor dict now
        elif r == 3:
            opt[f"p{rng.randrange(9)}/s"] = {"m": rng.choice(pool)}  # a key (escaped) added
        elif r == 4:
            del opt[k]
        elif r == 5:
            opt["param_groups"] = [{"lr": rng.choice([0.1, rng.choice(pool)])}]
        elif r == 6 and isinstance(opt[k], dict):
            opt[k] = dict(reversed(opt[k].items()))  # the same inner keys, in another order
        elif r == 7 and isinstance(opt[k], dict) and opt[k]:
            last = list(opt[k])[-1]  # renamed, as long as it was
            opt[k] = {(kk.swapcase() if kk == last else kk): v for kk, v in opt[k].items()}
        # (8, 9: unchanged)

    memo: dict[str, Any] = {}
    opt: dict[str, Any] = {}
    for i in range(400):
        if i % 20 == 0:  # (afresh now and then: mutations wear the leading tensor dicts away)
            opt = {f"p{i}": {"step": rng.choice(pool), "m": rng.choice(pool)} for i in range(6)}
            opt["param_groups"] = [{"lr": 0.1}]
        elif rng.random() < 0.5:
            mutate(opt)
        state = {"optim": opt, "model": {"w": pool[0]}}
        got, want = flatten(state, memo=memo), flatten(state)
        assert got[0] == want[0] and got[2] == want[2]
        assert list(got[1]) == list(want[1]) and all(got[1][k] is want[1][k] for k in want[1])
    nested = {"a": {"b": pool[0]}, "c": {"d": pool[1]}}
    flatten({1: nested}, memo=memo)  # (remembered at "1/")
    for _ in range(2):
        with pytest.raises(InvalidNameError, match="two tensors map to the name '1/a/b'"):
            flatten({1: nested, "1": nested}, memo=memo)
    assert flatten({1: nested}, memo=memo)[0] == flatten({1: nested})[0]


def test_lists_and_tuples_of_scalars_round_trip_exactly() -> None:
    """Lists and tuples whose items are all None/bool/int/str are taken as
    they are in one pass (random.getstate()'s 625 ints every step); with a
    float, a subclass or a container among them, item by item as before:
    the same tree and the same values back, types included."""
    import enum

    from dstt.errors import UnsupportedValueError
    from dstt.store.tree import flatten, unflatten

    class Level(enum.IntEnum):
        HIGH = 2

    state = {"py": random.getstate(), "l": [1, "a", None, True], "t": (3, False), "mixed": (1, 2.5, float("nan")),
             "nested": [(1, 2), [3, [4]]], "empty": ()}
    tree, tensors, _ = flatten(state)
    assert not tensors and tree["t"] == {"$tuple": [3, False]} and tree["l"] == [1, "a", None, True]
    back = unflatten(tree, lambda name, kind: None)
    assert back["py"] == state["py"] and type(back["py"][1]) is tuple
    assert back["t"] == (3, False) and type(back["t"][1]) is bool and back["nested"] == [(1, 2), [3, [4]]]
    assert back["mixed"][:2] == (1, 2.5) and back["mixed"][2] != back["mixed"][2] and back["empty"] == ()
    with pytest.raises(UnsupportedValueError, match="at e/1: cannot store"):
        flatten({"e": [1, Level.HIGH]})  # (an int subclass: never stored as a plain int)
