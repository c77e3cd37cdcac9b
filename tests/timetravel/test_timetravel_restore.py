"""dstt.restore: into live objects, all-or-nothing validation, FSDP2 resharding."""

from __future__ import annotations

import copy
import random
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

import dstt
from dstt.format.writeoptions import WriteOptions
from tests.conftest import bits_equal

ROOT = Path(__file__).resolve().parents[2]


def make(width: int = 4, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.BatchNorm1d(width), torch.nn.Linear(width, 2))
    m[2].to(torch.bfloat16)
    opt = torch.optim.AdamW(m.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return m, opt, sched


def train(m: torch.nn.Module, opt: torch.optim.Optimizer, sched: object, steps: int) -> None:
    for _ in range(steps):
        h = m[1](m[0](torch.randn(6, 3)))
        m[2](h.to(torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def snapshot(m: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    return copy.deepcopy(m.state_dict()), copy.deepcopy(opt.state_dict())


def assert_same(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    (ma, oa), (mb, ob) = a, b
    assert list(ma) == list(mb)
    for k in ma:
        assert bits_equal(ma[k], mb[k]), k
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for i in oa["state"]:
        for k, v in oa["state"][i].items():
            assert bits_equal(v, ob["state"][i][k]), (i, k)


def test_restore_into_fresh_objects_is_exact(store: Path) -> None:
    m, opt, sched = make()
    train(m, opt, sched, 3)
    dstt.save(store, 3, dstt.state_of(model=m, optimizer=opt, scheduler=sched, rng=True,
                                      extra={"pos": 17, "order": [3, 1, 2]}))
    expected_draws = (torch.rand(3), np.random.rand(2), random.random())
    want = snapshot(m, opt)
    m2, opt2, sched2 = make(seed=1)  # different weights, empty Adam state
    assert opt2.state_dict()["state"] == {}
    extra = dstt.restore(f"{store}:3", model=m2, optimizer=opt2, scheduler=sched2)
    assert extra == {"pos": 17, "order": [3, 1, 2]}
    assert_same(snapshot(m2, opt2), want)
    assert sched2.state_dict() == sched.state_dict()
    draws = (torch.rand(3), np.random.rand(2), random.random())
    assert torch.equal(draws[0], expected_draws[0]) and np.array_equal(draws[1], expected_draws[1])
    assert draws[2] == expected_draws[2]
    # The restored pair keeps training exactly like the original.
    torch.manual_seed(5)
    train(m, opt, sched, 2)
    torch.manual_seed(5)
    train(m2, opt2, sched2, 2)
    assert_same(snapshot(m2, opt2), snapshot(m, opt))


def test_rng_false_leaves_rng_alone(store: Path) -> None:
    m, opt, _ = make()
    dstt.save(store, 0, dstt.state_of(model=m, rng=True))
    torch.manual_seed(123)
    expected = torch.rand(2)
    torch.manual_seed(123)
    dstt.restore(store, model=m, rng=False)
    assert torch.equal(torch.rand(2), expected)


def test_mismatch_lists_every_problem_and_changes_nothing(store: Path) -> None:
    m, opt, sched = make()
    train(m, opt, sched, 2)
    dstt.save(store, 2, dstt.state_of(model=m, optimizer=opt, scheduler=sched, rng=False))
    other = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2),
                                torch.nn.Linear(2, 2))
    oopt = torch.optim.AdamW(other.parameters(), lr=0.5)
    other(torch.randn(6, 3)).sum().backward()
    oopt.step()
    other[2].to(torch.float64)
    before = snapshot(other, oopt)
    with pytest.raises(dstt.RestoreMismatchError) as ei:
        dstt.restore(f"{store}:2", model=other, optimizer=oopt)
    msg = str(ei.value)
    assert "missing keys ['3.weight', '3.bias']" in msg
    assert "model/0.weight: stored (4, 3) float32, live (5, 3) float32" in msg
    assert "model/2.weight: stored (2, 4) bfloat16, live (2, 5) float64" in msg
    assert "optim: group 0 missing parameters ['3.weight', '3.bias']" in msg
    assert "nothing was restored" in msg and "\n" not in msg
    assert any("optim/0.weight/exp_avg" in p for p in ei.value.problems)
    assert_same(snapshot(other, oopt), before)  # untouched, bit for bit

    # Unexpected keys, and a step without the scheduler that is asked for.
    small = torch.nn.Sequential(torch.nn.Linear(3, 4))
    with pytest.raises(dstt.RestoreMismatchError, match=r"unexpected keys \['1.weight'"):
        dstt.restore(store, model=small)
    dstt.save(store, 3, dstt.state_of(model=m, rng=False))
    with pytest.raises(dstt.RestoreMismatchError, match="the step has no scheduler state"):
        dstt.restore(store, model=m, scheduler=sched)


def test_strict_false_loads_what_matches(store: Path) -> None:
    m, opt, sched = make()
    train(m, opt, sched, 2)
    dstt.save(store, 2, dstt.state_of(model=m, optimizer=opt, rng=False))
    grown = torch.nn.Sequential(*make()[0], torch.nn.Linear(2, 2))
    gopt = torch.optim.AdamW(grown.parameters(), lr=0.5)
    fresh_last = grown[3].weight.detach().clone()
    with pytest.warns(UserWarning, match="partial restore"):
        dstt.restore(store, model=grown, optimizer=gopt, strict=False)
    assert bits_equal(grown[0].weight, m[0].weight) and bits_equal(grown[2].weight, m[2].weight)
    assert bits_equal(grown[3].weight, fresh_last)
    assert bits_equal(gopt.state[grown[0].weight]["exp_avg"], opt.state[m[0].weight]["exp_avg"])
    assert grown[3].weight not in gopt.state
    assert gopt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]

    # A parameter whose stored state does not fit starts with fresh state and still trains.
    lin = torch.nn.Linear(3, 4)
    lopt = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(2, 3)).sum().backward()
    lopt.step()
    dstt.save(store.parent / "single", 0, dstt.state_of(model=lin, optimizer=lopt, rng=False))
    narrow = torch.nn.Linear(3, 4)
    narrow.weight = torch.nn.Parameter(torch.randn(4, 5))
    nopt = torch.optim.AdamW(narrow.parameters())
    with pytest.warns(UserWarning, match="weight: stored"):
        dstt.restore(store.parent / "single", model=narrow, optimizer=nopt, strict=False)
    assert bits_equal(narrow.bias, lin.bias) and narrow.weight not in nopt.state
    assert bits_equal(nopt.state[narrow.bias]["exp_avg"], lopt.state[lin.bias]["exp_avg"])
    narrow(torch.randn(2, 5)).sum().backward()
    nopt.step()


def run_job(*args: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tests/scripts/fsdp_job.py"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.distributed
def test_fsdp2_capture_two_ranks_restore_one_and_three(tmp_path: Path) -> None:
    store = tmp_path / "run"
    run_job("capture", str(store), str(tmp_path / "cap"), "--world", "2")
    cap = [torch.load(tmp_path / "cap" / f"rank{r}.pt") for r in range(2)]
    full = dstt.open(store).state_dict(2)

    # World size 1: a plain (unsharded) model gets the full tensors.
    import importlib.util

    spec = importlib.util.spec_from_file_location("fsdp_job", ROOT / "tests/scripts/fsdp_job.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    plain = job.build_model()
    popt = torch.optim.Adam(plain.parameters(), lr=1e-2)
    assert dstt.restore(f"{store}:2", model=plain, optimizer=popt) == {"pos": 12}
    for n, p in plain.named_parameters():
        assert bits_equal(p, full["model"][n])
        for k, v in popt.state[p].items():
            assert bits_equal(v, full["optim"][n][k])
    assert torch.equal(torch.rand(4), cap[0]["rand"])  # single process takes rank 0's RNG
    job.train_step(plain, popt, seed=7)

    # World size 3: every rank reads only its own shard boxes.
    run_job("restore", f"{store}:2", str(tmp_path / "r3"), "--world", "3")
    for r in range(3):
        res = torch.load(tmp_path / "r3" / f"rank{r}.pt")
        assert res["extra"] == {"pos": 12}
        local_boxes = {}
        for name, (off, local) in res["local"].items():
            head, rest = name.split("/", 1)
            ref = full[head] if head == "model" else full["optim"]
            value = ref[rest] if head == "model" else ref[rest.rsplit("/", 1)[0]][rest.rsplit("/", 1)[1]]
            box = tuple(slice(o, o + n) for o, n in zip(off, local.shape))
            assert bits_equal(local, value[box] if box else value), (r, name)
            local_boxes[name] = (tuple(off), tuple(local.shape))
        for name, off, shape in res["boxes"]:
            if name in local_boxes and len(shape) > 0:
                assert (off, shape) == local_boxes[name], (r, name)  # nothing beyond its shard
        if r < 2:  # per-rank RNG: ranks the capture had get their own state back
            assert torch.equal(res["rand"], cap[r]["rand"])
        # One more step on 3 ranks matches the same step on one process.
        for n, p in plain.named_parameters():
            torch.testing.assert_close(res["after"][n], p.detach(), rtol=1e-5, atol=1e-6)


def test_corrupt_chunk_fails_before_anything_changes(store: Path) -> None:
    m, opt, sched = make()
    train(m, opt, sched, 1)
    dstt.save(store, 1, dstt.state_of(model=m, optimizer=opt, rng=False))
    entry = dstt.open(store).record(1).by_name["model/2.weight"]
    from dstt.format import layout as L

    chunk = store / L.chunk_key(entry.array, entry.slots[0], entry.coords(0))
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0xFF
    chunk.write_bytes(bytes(data))
    m2, opt2, _ = make(seed=3)
    before = snapshot(m2, opt2)
    with pytest.raises(dstt.ChecksumMismatchError):
        dstt.restore(store, model=m2, optimizer=opt2)
    assert_same(snapshot(m2, opt2), before)


# ----------------------------------------------------------------------------- values beyond flat float32 tensors


def _roundtrip(store: Path, build: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]],
               step: Callable[[torch.nn.Module, torch.optim.Optimizer], None], n: int = 3) -> None:
    """Train, save, restore into freshly built objects, train both on: bit-identical."""
    m, opt = build()
    for _ in range(n):
        step(m, opt)
    dstt.save(store, 0, dstt.state_of(model=m, optimizer=opt, rng=False))
    m2, opt2 = build()
    dstt.restore(f"{store}:0", model=m2, optimizer=opt2)
    for a, b in ((m, m2), (opt, opt2)):
        sa, sb = a.state_dict(), b.state_dict()
        assert repr(sa) == repr(sb)  # same structure and values, nothing left as a placeholder
    torch.manual_seed(9)
    step(m, opt)
    torch.manual_seed(9)
    step(m2, opt2)
    for (k, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert bits_equal(a, b), k


def test_eight_byte_dtypes_restore_to_tensors_that_save_again(store: Path, tmp_path: Path) -> None:
    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 5).double()  # 5 rows: chunked with padding below
        return m, torch.optim.Adam(m.parameters())

    def step(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        m(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
        opt.step()
        opt.zero_grad()

    _roundtrip(store, build, step)
    m2, opt2 = build()
    dstt.restore(f"{store}:0", model=m2, optimizer=opt2)
    for t in (*m2.state_dict().values(), *opt2.state_dict()["state"][0].values()):
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()  # owns exactly its bytes
    torch.save(opt2.state_dict(), tmp_path / "opt.pt")  # a restored state saves and loads again
    torch.load(tmp_path / "opt.pt", weights_only=True)
    with dstt.Writer(tmp_path / "chunked", WriteOptions(max_chunk_bytes=16)) as w:  # many chunks, a padded last one
        w.write(0, {"t": torch.arange(7, dtype=torch.int64)})
    dstt.export(f"{tmp_path / 'chunked'}:0", tmp_path / "x.pt")
    assert torch.equal(torch.load(tmp_path / "x.pt", weights_only=True)["t"], torch.arange(7))


def test_tensors_nested_in_other_values_are_restored(store: Path) -> None:
    class WithExtra(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)
            self.amax = torch.zeros(3)

        def get_extra_state(self) -> dict:
            return {"amax": self.amax, "n": 7}

        def set_extra_state(self, state: dict) -> None:
            self.amax = state["amax"]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.amax = torch.maximum(self.amax, x.abs().amax(0))
            return self.lin(x)

    def build_extra() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = WithExtra()
        return m, torch.optim.Adam(m.parameters(), lr=torch.tensor(1e-2))  # a tensor lr in param_groups

    def step_extra(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        m(torch.randn(4, 3)).sum().backward()
        opt.step()
        opt.zero_grad()

    _roundtrip(store, build_extra, step_extra)

    def build_lbfgs() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 1)
        return m, torch.optim.LBFGS(m.parameters(), history_size=3, max_iter=2)  # lists of tensors in state

    x, y = torch.randn(8, 3), torch.randn(8, 1)

    def step_lbfgs(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = (m(x) - y).pow(2).mean()
            loss.backward()
            return loss
        opt.step(closure)

    _roundtrip(tmp_store(store, "lbfgs"), build_lbfgs, step_lbfgs)


def tmp_store(store: Path, name: str) -> Path:
    return store.parent / name


def test_factored_optimizer_state_restores_and_reshaped_state_is_refused(store: Path) -> None:
    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 4)
        return m, torch.optim.Adafactor(m.parameters(), lr=1e-2)  # row/col variances: (4, 1), (1, 3)

    def step(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        m(torch.randn(5, 3)).sum().backward()
        opt.step()
        opt.zero_grad()

    _roundtrip(store, build, step)
    # A parameter reshaped from (12,) to (4, 3): its Adam state no longer fits, even without model=.
    p = torch.nn.Parameter(torch.randn(12))
    opt = torch.optim.Adam([("w", p)])  # named parameters: state keyed by name without model=
    p.sum().backward()
    opt.step()
    dstt.save(tmp_store(store, "reshaped"), 0, {"optim": dstt.optimizer_state(opt)})
    q = torch.nn.Parameter(torch.randn(4, 3))
    opt2 = torch.optim.Adam([("w", q)])
    before = copy.deepcopy(opt2.state_dict())
    with pytest.raises(dstt.RestoreMismatchError, match=r"optim/w/exp_avg: stored \(12,\) float32, live \(4, 3\)"):
        dstt.restore(f"{tmp_store(store, 'reshaped')}:0", optimizer=opt2)
    assert opt2.state_dict() == before


def test_a_different_optimizer_or_scheduler_type_is_not_loaded(store: Path) -> None:
    m = torch.nn.Linear(3, 2)
    sgd = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(sgd, step_size=3)
    m(torch.randn(4, 3)).sum().backward()
    sgd.step()
    sched.step()
    dstt.save(store, 0, dstt.state_of(model=m, optimizer=sgd, scheduler=sched, rng=False))
    adam = torch.optim.Adam(m.parameters())
    with pytest.raises(dstt.RestoreMismatchError, match="a different optimizer type"):
        dstt.restore(f"{store}:0", optimizer=adam, model=m)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(torch.optim.SGD(m.parameters(), lr=0.1), T_max=10)
    before = cosine.state_dict()
    with pytest.warns(UserWarning, match="partial restore"):
        dstt.restore(f"{store}:0", model=m, optimizer=adam, scheduler=cosine, strict=False)
    assert cosine.state_dict() == before  # left as is, not half-loaded with StepLR's keys
    assert adam.state_dict()["state"] == {}  # SGD state never loaded into Adam


def test_restore_checks_chunks_against_the_step_index(store: Path) -> None:
    """A valid chunk in the wrong place (here: step 0's, copied over step 1's)."""
    m = torch.nn.Linear(3, 2)
    dstt.save(store, 0, dstt.state_of(model=m, rng=False))
    with torch.no_grad():
        m.weight.add_(1)
    dstt.save(store, 1, dstt.state_of(model=m, rng=False))
    run = dstt.open(store)
    e0, e1 = run.record(0).by_name["model/weight"], run.record(1).by_name["model/weight"]
    from dstt.format import layout as L

    src = store / L.chunk_key(e0.array, e0.slots[0], e0.coords(0))
    (store / L.chunk_key(e1.array, e1.slots[0], e1.coords(0))).write_bytes(src.read_bytes())
    m2 = torch.nn.Linear(3, 2)
    before = copy.deepcopy(m2.state_dict())
    with pytest.raises(dstt.ChecksumMismatchError, match="does not match the step index"):
        dstt.restore(f"{store}:1", model=m2)
    assert all(bits_equal(a, b) for a, b in zip(before.values(), m2.state_dict().values()))
    with pytest.raises(dstt.ChecksumMismatchError, match="does not match the step index"):
        dstt.export(f"{store}:1", store.parent / "x.safetensors")


def test_stored_param_names_never_replace_the_live_order(store: Path) -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(m.named_parameters())  # records param_names
    m(torch.randn(5, 3)).sum().backward()
    opt.step()
    dstt.save(store, 0, dstt.state_of(model=m, optimizer=opt, rng=False))
    opt2 = torch.optim.Adam(list(m.parameters())[::-1])  # no names, the reverse order
    dstt.restore(f"{store}:0", model=m, optimizer=opt2)
    assert "param_names" not in opt2.state_dict()["param_groups"][0]
    state = dstt.optimizer_state(opt2, model=m)
    for name, p in m.named_parameters():
        assert state[name]["exp_avg"].shape == p.shape, name
