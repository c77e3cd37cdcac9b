"""Bit-exact round trips of tensors and values through dstt.save / dstt.open."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dstt
from tests.conftest import bits_equal

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
]


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, rng: np.random.Generator) -> torch.Tensor:
    """A tensor whose bytes are uniformly random: every NaN payload, -0.0, inf."""
    n = math.prod(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(rng.integers(0, 256, size=n * itemsize, dtype=np.uint8))
    if dtype == torch.bool:
        return (raw % 2).to(torch.bool).reshape(shape)
    return raw.view(dtype).reshape(shape)


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)
leaf_dtypes = st.sampled_from(DTYPES)


@st.composite
def states(draw: st.DrawFn) -> dict:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def tensor() -> torch.Tensor:
        t = random_bits(draw(shapes), draw(leaf_dtypes), rng)
        if t.dim() >= 2 and draw(st.booleans()):
            t = t.transpose(0, 1)  # non-contiguous
        return t

    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.text(max_size=8),
        st.floats(allow_nan=True, allow_infinity=True),
    )
    leaves = st.one_of(scalars, st.just("TENSOR"))
    tree = st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.dictionaries(st.text(alphabet="abc./%$_", min_size=1, max_size=4), children, max_size=3),
            st.dictionaries(st.integers(-3, 3), children, max_size=3),
        ),
        max_leaves=8,
    )

    def fill(x: object) -> object:
        if x == "TENSOR":
            return tensor()
        if isinstance(x, dict):
            return {k: fill(v) for k, v in x.items()}
        if isinstance(x, list):
            return [fill(v) for v in x]
        if isinstance(x, tuple):
            return tuple(fill(v) for v in x)
        return x

    return {"model": {"w": tensor()}, "extra": fill(draw(tree))}


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and bits_equal(a, b)
    if isinstance(a, float):
        return isinstance(b, float) and (a == b and math.copysign(1, a) == math.copysign(1, b) or (a != a and b != b))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def perturbed(x: object, rng: np.random.Generator) -> object:
    """``x`` with every tensor's bits changed a little (same shapes and dtypes)."""
    if isinstance(x, torch.Tensor):
        out = x.detach().clone().contiguous()
        if out.numel():
            flat = out.view(-1) if out.dtype == torch.bool else out.view(-1).view(torch.uint8)
            i = int(rng.integers(0, flat.numel()))
            flat[i] = ~flat[i] if out.dtype == torch.bool else flat[i] ^ 0x11
        return out
    if isinstance(x, dict):
        return {k: perturbed(v, rng) for k, v in x.items()}
    if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
        return type(x)(perturbed(v, rng) for v in x)
    return x


def save_read(path: Path, state: dict, compression: str, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Save ``state`` and read it back. With delta coding, a perturbed copy
    is saved first, so every tensor of ``state`` is stored as a delta against
    it (every delta kept, however large)."""
    step = 0
    if compression == "delta":
        from dstt.format.codecs import keyframes

        monkeypatch.setattr(keyframes, "DELTA_MAX_RATIO", math.inf)
        dstt.save(path, 0, perturbed(state, np.random.default_rng(0)), compression=compression)
        step = 1
    dstt.save(path, step, state, compression=compression)
    return dstt.open(path).state_dict(step)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(state=states())
@pytest.mark.parametrize("compression", ["none", "delta"])
def test_roundtrip_bit_exact(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
                             compression: str, state: dict) -> None:
    path = tmp_path_factory.mktemp("rt") / "run"
    try:
        back = save_read(path, state, compression, monkeypatch)
    except dstt.InvalidNameError:
        return  # two keys that map to one tensor name ("1" and 1) are refused, tested below
    assert same(state, back)


@pytest.mark.parametrize("compression", ["none", "delta"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_dtype_bit_exact_with_special_values(store: Path, dtype: torch.dtype, compression: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    t = random_bits((7, 5), dtype, rng)
    if dtype.is_floating_point and dtype.itemsize >= 2:
        t[0, 0] = -0.0
        t[0, 1] = float("nan")
        t[0, 2] = float("inf")
    state = {"t": t, "scalar": t[1, 1].clone(), "empty": t[:0], "strided": t[:, ::2]}
    back = save_read(store, state, compression, monkeypatch)
    for k, v in state.items():
        assert bits_equal(back[k], v), k
        assert back[k].dtype == dtype
    run = dstt.open(store)
    step = run.steps()[-1]
    if compression == "delta" and dtype.itemsize <= 8:
        assert run.entry("t", step).keyframes == [run.entry("t", 0).slots[0]]
    assert bits_equal(run.read("t", step, index=(slice(2, 5), 3)), t[2:5, 3].contiguous())


@pytest.mark.parametrize("compression", ["none", "delta"])
def test_nan_payloads_survive(store: Path, compression: str, monkeypatch: pytest.MonkeyPatch) -> None:
    payloads = torch.tensor([0x7FC00001, 0x7F800123, 0xFFC0BEEF, 0x80000000], dtype=torch.int64).to(torch.int32)
    t = payloads.view(torch.float32)
    back = save_read(store, {"t": t}, compression, monkeypatch)
    assert back["t"].view(torch.int32).tolist() == payloads.tolist()


def test_values_keep_python_types(store: Path) -> None:
    extra = {
        "i": 3, "big": 2**80, "f": 1.0, "inf": float("inf"), "ninf": float("-inf"), "nan": float("nan"),
        "s": "héllo", "none": None, "b": True, "l": [1, [2, (3, 4.5)]], "t": (1, "x", None),
        "nested": {"a": {"b": {"c": [None]}}}, 7: "int key", (1, 2): "tuple key", "$weird": 1,
        "bytes": b"\x00\xff", "dt": torch.bfloat16, "np": np.int64(5),
    }
    dstt.save(store, 0, {"extra": extra})
    back = dstt.open(store).state_dict(0)["extra"]
    assert same({k: v for k, v in extra.items() if k != "np"}, {k: v for k, v in back.items() if k != "np"})
    assert back["np"] == 5 and isinstance(back["np"], np.int64)


def test_training_state_roundtrip(store: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    model(torch.randn(8, 6)).sum().backward()
    opt.step()
    sched.step()
    random.random()
    np.random.rand()
    state = dstt.state_of(model=model, optimizer=opt, scheduler=sched, rng=True, extra={"epoch": 2})
    dstt.save(store, 1, state)
    back = dstt.open(store).state_dict(1)
    for k, v in model.state_dict().items():
        assert bits_equal(back["model"][k], v), k
    assert back["optim"]["param_groups"][0]["params"] == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]
    assert bits_equal(back["optim"]["0.weight"]["exp_avg"], opt.state[model[0].weight]["exp_avg"])
    assert back["scheduler"] == sched.state_dict()
    assert bits_equal(back["rng"]["torch"], torch.get_rng_state())
    np_state = np.random.get_state()
    assert back["rng"]["numpy"][0] == np_state[0] and np.array_equal(back["rng"]["numpy"][1], np_state[1])
    assert back["rng"]["python"] == random.getstate()
    # the restored optimizer state loads into a freshly built optimizer
    fresh = torch.optim.AdamW(model.parameters(), lr=1.0)
    from dstt.store.state import optimizer_state_dict_from

    fresh.load_state_dict(optimizer_state_dict_from(back["optim"], fresh, model))
    assert fresh.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert bits_equal(fresh.state[model[2].bias]["exp_avg_sq"], opt.state[model[2].bias]["exp_avg_sq"])


def test_numpy_arrays_come_back_as_numpy(store: Path) -> None:
    a = np.arange(12, dtype=np.uint16).reshape(3, 4)[:, ::2]
    dstt.save(store, 0, {"a": a})
    back = dstt.open(store).state_dict(0)["a"]
    assert isinstance(back, np.ndarray) and back.dtype == np.uint16 and np.array_equal(back, a)


def test_memory_url_uses_the_same_path() -> None:
    url = "memory://dstt-test-roundtrip"
    t = torch.randn(4, 3).to(torch.bfloat16)
    dstt.save(url, 0, {"t": t})
    dstt.save(url, 1, {"t": t * 2})
    run = dstt.open(url)
    assert run.steps() == [0, 1]
    assert bits_equal(run.read("t", 1), t * 2)
    assert run.commit_info(1)["bytes_written"] > 0


def test_numpy_values_keep_their_type_and_shape(store: Path) -> None:
    """np.float64 is a float subclass: it used to come back as a plain float.
    np.ascontiguousarray makes 0-d arrays 1-d: a 0-d array came back as (1,)."""
    state = {"loss": np.float64(0.25), "nan": np.float64("nan"), "scalar": np.array(5.0),
             "bits": np.array(-0.0, dtype=np.float32), "t": torch.zeros(1)}
    dstt.save(store, 0, state)
    back = dstt.open(store).state_dict(0)
    assert type(back["loss"]) is np.float64 and back["loss"] == 0.25
    assert type(back["nan"]) is np.float64 and back["nan"] != back["nan"]
    for k in ("scalar", "bits"):
        assert isinstance(back[k], np.ndarray) and back[k].shape == () and back[k].dtype == state[k].dtype, k
        assert back[k].tobytes() == state[k].tobytes(), k


def test_conjugate_and_negative_views_round_trip(store: Path) -> None:
    """A lazy conjugate view (complex .conj()) made the step fail: numpy
    refuses tensors with the conjugate bit."""
    z = torch.randn(4, 3, dtype=torch.complex64)
    state = {"conj": z.conj(), "neg": torch._neg_view(z), "conj_t": z.conj().t()}
    dstt.save(store, 0, state)
    back = dstt.open(store).state_dict(0)
    for k, v in state.items():
        assert bits_equal(back[k], v.resolve_conj().resolve_neg()), k
