"""Planning at scale (issue 16): the fast paths of planning (memoized name
escaping, one-region layouts, one-chunk tasks, the per-name plan cache of a
single process) give exactly what the general path gives, refuse the same
names, and captures through them stay bit-exact while layouts change."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

import dstt
from dstt.errors import InvalidNameError
from dstt.format import layout as L
from dstt.format.codecs.spec import CodecSpec
from dstt.format.geometry import build_layout, check_tiling, choose_chunk_shape, interior_boundaries
from dstt.store.plan import describe_local, plan_step


def _slow_escape(part: str) -> str:
    """The reference escaping: every character outside the safe set
    percent-encoded, '.', '..' and '' encoded whole, a leading '__' broken."""
    if part in ("", ".", ".."):
        return "".join(f"%{ord(c):02X}" for c in part) or "%00"
    out = "".join(c if c in L._SAFE_CHARS else "".join(f"%{b:02X}" for b in c.encode("utf-8")) for c in part)
    return "%5F" + out[1:] if out.startswith("__") else out


def test_escape_component_memo_and_fast_path_match_the_reference() -> None:
    rng = random.Random(7)
    alphabet = "ab._-%_ é/\x00Z9"
    for _ in range(5000):
        part = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 10)))
        want = _slow_escape(part)
        assert L.escape_component(part) == want
        assert L.escape_component(part) == want  # memoized the second time
    with pytest.raises(InvalidNameError, match="not valid Unicode"):
        L.escape_component("bad\ud800")
    with pytest.raises(InvalidNameError, match="not valid Unicode"):
        L.escape_component("bad\ud800")  # an error is never memoized as a result


def _nested(parts: list[str], value: Any) -> Any:
    for p in reversed(parts):
        value = {p: value}
    return value


@pytest.mark.parametrize("parts, why", [
    (["x" * 300], "at most 255"),
    (["a" * 80] * 60, "nested too deeply"),
    (["ok", "\udc80"], "not valid Unicode"),
], ids=["long-component", "deep", "surrogate"])
def test_bad_names_refused_at_planning_every_time(tmp_path: Path, parts: list[str], why: str) -> None:
    """A name no store could hold is refused when the step is planned, also
    when planned again (memoized prefixes keep the check), and nothing is
    committed."""
    path = tmp_path / "run"
    for step in range(2):
        with pytest.raises(InvalidNameError, match=why):
            dstt.save(path, step, _nested(parts, torch.ones(2)))
    assert dstt.open(path).steps() == []


def _general_layout(name: str, desc: tuple[Any, ...], codec: CodecSpec, max_bytes: int) -> Any:
    """What build_layout computed before its one-region fast path."""
    kind, dtype, shape, _mode, raw = desc
    from dstt.format.dtypes import info_for_name
    from dstt.format.geometry import Region
    regions = [Region(tuple(o), tuple(s), sorted(h)) for o, s, h in raw]
    check_tiling(tuple(shape), regions, name)
    chunk = choose_chunk_shape(tuple(shape), info_for_name(dtype).itemsize,
                               interior_boundaries(tuple(shape), regions), max_bytes)
    return chunk, regions


@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (3, 5), (64, 33), (4, 0, 2)])
def test_one_region_layout_fast_path_equals_the_general_path(shape: tuple[int, ...]) -> None:
    t = torch.zeros(shape)
    desc = describe_local("m/w", "tensor", t, 0).describe()
    for max_bytes in (64, 1 << 20):
        layout = build_layout("m/w", desc, CodecSpec(), max_bytes)
        chunk, regions = _general_layout("m/w", desc, CodecSpec(), max_bytes)
        assert layout.chunk_shape == chunk and layout.regions == regions
        assert layout.array == L.array_path("m/w", layout.sig)
        assert layout.meta_owner_rank == 0


def _plan_summary(plan: Any) -> list[Any]:
    return [(t.layout.name, t.layout.sig, t.index, t.coords, t.offset, t.shape, t.source.data_ptr(),
             tuple(t.source.shape), tuple(t.source.stride())) for t in plan.tasks] + \
        [("meta", m.name) for m in plan.meta_arrays] + [(lay.name, lay.array) for lay in plan.layouts]


def test_cached_plan_equals_the_uncached_plan_over_changing_steps() -> None:
    """The per-name plan cache of a single process (plan_step with a
    layout_cache) gives the same tasks, views and layouts as planning from
    scratch, step after step, while tensors keep, change shape or dtype,
    start requiring grad, appear and disappear."""
    cache: dict[Any, Any] = {}
    state: dict[str, Any] = {
        "scalar": torch.tensor(3.0), "empty": torch.zeros(0, 4), "small": torch.arange(6.0),
        "big": torch.randn(40, 30), "p": torch.nn.Parameter(torch.ones(5)),
    }
    for step in range(6):
        if step == 2:
            state["small"] = torch.arange(8.0)  # new shape, same name
        if step == 3:
            state["small"] = state["small"].to(torch.float64)  # new dtype
            state["new"] = torch.ones(3, dtype=torch.int32)
        if step == 4:
            state["big"].requires_grad_(True)
            del state["scalar"]
        cached = plan_step(step, state, layout_cache=cache, max_chunk_bytes=1024)
        fresh = plan_step(step, state, max_chunk_bytes=1024)
        assert _plan_summary(cached) == _plan_summary(fresh)
        assert all(not t.source.requires_grad for t in cached.tasks)


def test_capture_bit_exact_while_layouts_change(tmp_path: Path) -> None:
    """A Capture through the cached plans stores every step bit for bit,
    with unchanged steps, a shape change, a dtype change and a tensor added."""
    path = tmp_path / "run"
    torch.manual_seed(0)
    state: dict[str, Any] = {f"t{i:03d}": torch.randn(17) for i in range(50)}
    state["big"] = torch.randn(300, 7)
    expected: dict[int, dict[str, torch.Tensor]] = {}
    with dstt.Capture(path, max_chunk_bytes=1024) as cap:
        for step in range(8):
            if step == 3:
                state["t005"] = torch.randn(4, 4)
            if step == 5:
                state["t007"] = state["t007"].to(torch.bfloat16)
                state["added"] = torch.arange(9)
            for v in list(state.values())[::7]:
                v.add_(1)
            cap.snapshot(step, extra={"s": state}, rng=False)
            expected[step] = {k: v.clone() for k, v in state.items()}
            cap.wait()
    run = dstt.open(path)
    assert run.steps() == list(range(8))
    for step, want in expected.items():
        got = run.state_dict(step)["extra"]["s"]
        assert set(got) == set(want)
        for k, v in want.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), (step, k)


def _mixed_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Linear(10, 6).to(torch.bfloat16))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(4, 12)
    y = model[1](model[0](x).to(torch.bfloat16)).float().square().mean()
    opt.zero_grad()
    y.backward()
    opt.step()


def test_lazy_copies_in_runs_store_every_step_bit_exact(tmp_path: Path) -> None:
    """Parameters and Adam state of two dtypes, copied lazily in runs of one
    dtype (by the stager or the optimizer hook): every step stored is the
    state at its snapshot(), bit for bit."""
    model, opt = _mixed_model()
    path = tmp_path / "run"
    expected = {}
    with dstt.Capture(path) as cap:
        for step in range(12):
            _train_step(model, opt)
            cap.snapshot(step, model=model, optimizer=opt, rng=False)
            expected[step] = _tensors(dstt.state_of(model=model, optimizer=opt, rng=False))
    run = dstt.open(path)
    assert run.steps() == list(range(12))
    for step, want in expected.items():
        got = _tensors(run.state_dict(step))
        assert got.keys() == want.keys()
        dtypes = {v.dtype for v in want.values()}
        assert {torch.float32, torch.bfloat16} <= dtypes
        for k, v in want.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k].reshape(-1).view(torch.uint8),
                                                           v.reshape(-1).view(torch.uint8)), (step, k)


def _tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a state, by path, cloned."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, torch.Tensor):
        out[prefix] = tree.detach().clone()
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_tensors(v, f"{prefix}/{k}"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_tensors(v, f"{prefix}/{i}"))
    return out


def test_in_place_change_before_a_run_is_copied_never_stores_a_wrong_step(tmp_path: Path) -> None:
    """A parameter changed in place right after snapshot() (against the
    rule, no wait_staged()): each step is either stored with the values of
    its snapshot() (the run was copied first) or fails naming the change --
    never stored with the changed values."""
    model, opt = _mixed_model()
    path = tmp_path / "run"
    expected, failed = {}, 0
    cap = dstt.Capture(path)
    try:
        for step in range(15):
            _train_step(model, opt)
            try:
                cap.snapshot(step, model=model, optimizer=opt, rng=False)
            except dstt.CaptureError as e:
                assert "changed in place" in str(e)
                failed += 1
            expected[step] = model[0].weight.detach().clone()
            with torch.no_grad():
                model[0].weight.add_(1.0)  # outside optimizer.step(): breaks the rule
        try:
            cap.wait()
        except dstt.CaptureError as e:
            assert "changed in place" in str(e)
            failed += 1
    finally:
        try:
            cap.close()
        except dstt.CaptureError:
            failed += 1
    run = dstt.open(path)
    for step in run.steps():
        assert torch.equal(run.read("model/0.weight", step), expected[step]), step
    assert len(run.steps()) + failed >= 1


def test_flatten_names_plain_tensors_like_every_other_value() -> None:
    """flatten names a plain tensor of a dict on a short path (no path list
    per key): the same names, escaping and kinds as the general path gives
    a Parameter or an ndarray beside it."""
    from dstt.store.tree import flatten

    t, p = torch.zeros(2), torch.nn.Parameter(torch.ones(1))
    state = {"a/b": t, "x%y": {"q": t, "r": [t, {"s/t": p}]}, "top": p, "n": __import__("numpy").zeros(3)}
    tree, tensors, kinds = flatten(state)
    assert list(tensors) == ["a%2Fb", "x%25y/q", "x%25y/r/0", "x%25y/r/1/s%2Ft", "top", "n"]
    assert kinds == {**{k: "tensor" for k in list(tensors)[:5]}, "n": "ndarray"}
    assert tree["x%y"]["r"][1] == {"s/t": {"$tensor": "x%25y/r/1/s%2Ft"}}
    assert tensors["x%25y/q"] is t and tensors["top"] is p
    with pytest.raises(InvalidNameError, match="two tensors map to the name"):
        flatten({1: {"a": t}, "1": {"a": t}})
