"""dstt.Capture in one process: round trips, the consistency guarantee,
the staging pool, the skip policy and background failures."""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from conftest import bits_equal

import dstt
from dstt.capture import CaptureConfig, skipped_steps
from dstt.capture.engine import Capture
from dstt.capture.hostpool import HostPool
from dstt.capture.stager import Stager
from dstt.errors import CaptureError, ConfigError, StepOrderError
from dstt.format.backends import LocalBackend


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail (instead of hanging the suite) if the block runs past ``seconds``."""

    def boom(*_: Any) -> None:
        raise TimeoutError(f"capture test still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


class FaultyBackend(LocalBackend):
    """A local store that fails (or slows down) on chosen writes."""

    def __init__(self, root: Path, *, fail_chunk_after: int | None = None, exc: OSError | None = None,
                 fail_commit_of: int | None = None, delay: float = 0.0) -> None:
        super().__init__(root, create=True)
        self.fail_chunk_after = fail_chunk_after
        self.exc = exc or OSError(errno.ENOSPC, "No space left on device")
        self.fail_commit_of = fail_commit_of
        self.delay = delay
        self.chunk_puts = 0
        self._count = threading.Lock()

    def put(self, key: str, data: Any) -> None:
        if "/c." in key and key.startswith("tensors/"):
            time.sleep(self.delay)
            with self._count:
                self.chunk_puts += 1
                n = self.chunk_puts
            if self.fail_chunk_after is not None and n > self.fail_chunk_after:
                raise self.exc
        super().put(key, data)

    def put_atomic(self, key: str, data: Any) -> None:
        if self.fail_commit_of is not None and key.endswith(f"{self.fail_commit_of:020d}/commit.json"):
            raise OSError(errno.EACCES, "Permission denied")
        super().put_atomic(key, data)


class Net(torch.nn.Module):
    """Parameters, a BatchNorm (buffers that change during forward) and a
    parameter no optimizer updates."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, width)
        self.bn = torch.nn.BatchNorm1d(width)
        self.fc2 = torch.nn.Linear(width, 3)
        self.frozen = torch.nn.Parameter(torch.randn(5), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def make(seed: int = 0, width: int = 32) -> tuple[Net, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = Net(width)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def train_step(model: Net, opt: torch.optim.Optimizer, sched: Any = None) -> None:
    x = torch.randn(16, 8)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    if sched is not None:
        sched.step()


def clone_state(state: Any) -> Any:
    """A deep copy of a state's tensors, on the CPU."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu().clone()
    if isinstance(state, dict):
        return {k: clone_state(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(clone_state(v) for v in state)
    return state


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert bits_equal(a, b), f"{where}: stored tensor differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} vs {b!r}"


def reference(model: Net, opt: torch.optim.Optimizer, sched: Any, extra: dict | None = None) -> Any:
    return clone_state(dstt.state_of(model=model, optimizer=opt, scheduler=sched, extra=extra, rng=False))


def stored(store: Any, step: int) -> dict:
    sd = dstt.open(store).state_dict(step)
    sd.pop("rng", None)
    return sd


# ----------------------------------------------------------------------------- round trips


def test_every_step_round_trips_bit_exact(store: Path) -> None:
    model, opt, sched = make()
    refs = {}
    with deadline(60), dstt.Capture(store) as cap:
        for step in range(5):
            train_step(model, opt, sched)
            extra = {"loss": 0.5 / (step + 1), "ids": torch.arange(step + 3), "half": torch.randn(3).bfloat16()}
            assert cap.snapshot(step, model=model, optimizer=opt, scheduler=sched, extra=extra)
            refs[step] = reference(model, opt, sched, extra)
        cap.wait()
        assert [c.step for c in cap.committed] == list(range(5))
    assert dstt.open(store).steps() == list(range(5))
    for step, ref in refs.items():
        assert_same(ref, stored(store, step), f"step {step}")


def test_every_n_and_rng(store: Path) -> None:
    model, opt, sched = make()
    with deadline(60), dstt.Capture(store, every=3) as cap:
        for step in range(7):
            train_step(model, opt)
            before = torch.get_rng_state()
            queued = cap.snapshot(step, model=model, optimizer=opt, rng=True)
            assert queued == (step % 3 == 0)
            if queued:
                rng_ref = before
            torch.randn(100)  # the generator moves on after the snapshot
    assert dstt.open(store).steps() == [0, 3, 6]
    assert bits_equal(dstt.open(store).state_dict(6)["rng"]["torch"], rng_ref)


def test_all_dtypes_through_the_pool(store: Path) -> None:
    extra = {
        "f64": torch.randn(7, dtype=torch.float64),
        "f16": torch.randn(5, 3).half(),
        "bf16": torch.randn(9).bfloat16(),
        "i8": torch.randint(-100, 100, (13,), dtype=torch.int8),
        "bool": torch.rand(11) > 0.5,
        "c64": torch.randn(4, dtype=torch.complex64),
        "f8": torch.randn(6).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(6, 4).t(),
    }
    ref = clone_state(extra)
    with deadline(30), dstt.Capture(store) as cap:
        cap.snapshot(0, extra=extra, rng=False)
        for t in extra.values():  # no optimizer: everything was staged eagerly
            if t.numel():
                t.zero_() if t.dtype != torch.bool else t.fill_(False)
    assert_same({"extra": ref}, stored(store, 0))


def test_state_larger_than_pool_is_staged_in_parts(store: Path) -> None:
    model, opt, sched = make(width=256)  # fc1 weight is 8 KiB; the pool holds 4 chunks of 4 KiB
    with deadline(60), dstt.Capture(store, host_buffer_bytes=16 << 10, max_chunk_bytes=4 << 10) as cap:
        refs = {}
        for step in range(3):
            train_step(model, opt)
            cap.snapshot(step, model=model, optimizer=opt)
            refs[step] = reference(model, opt, None)
        assert cap.pool is not None and cap.pool.capacity == 16 << 10
    for step, ref in refs.items():
        assert_same(ref, stored(store, step), f"step {step}")


def test_config_is_validated(store: Path) -> None:
    with pytest.raises(ConfigError, match="max_chunk_bytes"):
        dstt.Capture(store, host_buffer_bytes=1 << 20, max_chunk_bytes=2 << 20)
    with pytest.raises(ConfigError, match="on_full"):
        CaptureConfig(on_full="drop")
    with pytest.raises(ConfigError, match="every"):
        CaptureConfig(every=0)
    with pytest.raises(dstt.InvalidReferenceError, match="parent"):  # (one validator per kind: store/args.py)
        CaptureConfig(parent=("main",))


def test_step_order_errors_are_immediate(store: Path) -> None:
    model, opt, _ = make()
    # (checked on the trainer's thread, before staging: no capture helper needed)
    with deadline(30), dstt.Capture(store, helper=False) as cap:
        cap.snapshot(5, model=model, optimizer=opt)
        with pytest.raises(StepOrderError):
            cap.snapshot(5, model=model, optimizer=opt)
    assert dstt.open(store).steps() == [5]


def test_new_branch_with_parent(store: Path) -> None:
    model, opt, _ = make()
    with dstt.Capture(store) as cap:
        cap.snapshot(0, model=model, optimizer=opt)
    train_step(model, opt)
    with deadline(30), dstt.Capture(store, branch="fork", parent=("main", 0)) as cap:
        cap.snapshot(1, model=model, optimizer=opt)
    run = dstt.open(store)
    assert run.steps("fork") == [1]
    assert run.branch_info("fork").parent == ("main", 0)


# ----------------------------------------------------------------------------- consistency


def slow_staging(cap: Capture, seconds: float = 0.3) -> None:
    """Delay every lazy copy on the stager thread (its ``before_lazy`` hook)
    so training code after snapshot() surely runs first. (Lazy CPU copies:
    the trainer's optimizer hook may make the copies itself -- work
    stealing -- at its own pace.)"""
    cap.parts.stager.before_lazy = lambda job: time.sleep(seconds)


def test_in_place_updates_after_snapshot_are_not_captured(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stored step equals the state at snapshot(), although parameters,
    optimizer state and BatchNorm buffers are all changed in place right
    after it returns (the pattern that broke DCP async_save, pytorch #144657)."""
    model, opt, sched = make()
    train_step(model, opt)
    with deadline(60), dstt.Capture(store) as cap:
        slow_staging(cap)
        for step in range(3):
            ref = reference(model, opt, sched)
            cap.snapshot(step, model=model, optimizer=opt, scheduler=sched)
            model(torch.randn(16, 8))  # forward: BatchNorm running stats change in place, now
            train_step(model, opt, sched)  # optimizer.step(): params, exp_avg, step change in place
            with torch.no_grad():  # and a mutation outside the optimizer, after wait_staged()
                cap.wait_staged()
                model.fc2.weight.add_(1.0)
            cap.wait()
            assert_same(ref, stored(store, step), f"step {step}")
    assert not bits_equal(ref["model"]["bn.running_mean"], model.bn.running_mean)
    assert not bits_equal(ref["optim"]["fc1.weight"]["exp_avg"], opt.state[model.fc1.weight]["exp_avg"])


def test_without_the_fence_the_race_is_real_and_the_guard_catches_it(store: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control for the test above: with the optimizer hook disabled
    the update runs before the lazy copy; the mutation guard (issue 12) then
    fails the step instead of storing post-update values silently."""
    monkeypatch.setattr(Stager, "before_optimizer_step", lambda self: None)  # (the pre-hook does nothing)
    model, opt, _ = make()
    train_step(model, opt)
    with deadline(60), dstt.Capture(store) as cap:
        slow_staging(cap)
        cap.snapshot(0, model=model, optimizer=opt)
        train_step(model, opt)
        with pytest.raises(CaptureError, match=r"step 0 not captured: tensor '.*'.*wait_staged\(\)"):
            cap.wait_staged()
    assert dstt.open(store).steps() == []  # never committed with post-update values


def test_a_starved_stager_does_not_hold_the_optimizer(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Work stealing: a stager that does not get the CPU (here: blocked until
    the trainer's next optimizer step is over) costs the trainer one memcpy,
    not the wait -- and the step stored is still the state at snapshot()."""
    released = threading.Event()
    model, opt, _ = make()
    train_step(model, opt)
    with deadline(60), dstt.Capture(store) as cap:
        def starved(job: Any) -> None:  # the stager thread: no CPU until released
            assert released.wait(30)

        cap.parts.stager.before_lazy = starved
        cap.snapshot(0, model=model, optimizer=opt)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        train_step(model, opt)  # would wait forever for the stager without stealing
        released.set()
    got = dstt.open(store).state_dict(0)["model"]
    assert all(bits_equal(got[k], v) for k, v in expected.items())
    assert not all(torch.equal(got[k], v) for k, v in model.state_dict().items())


def test_optimizer_step_waits_for_staging(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, _ = make()
    train_step(model, opt)
    seen = []
    with deadline(60), dstt.Capture(store) as cap:
        slow_staging(cap, 0.2)
        cap.snapshot(0, model=model, optimizer=opt)
        job = cap.parts.last_job
        assert job is not None and not job.staged.is_set()  # snapshot() did not wait for the copy
        opt.register_step_pre_hook(lambda *a: seen.append(job.staged.is_set()))
        train_step(model, opt)
    assert seen == [True]


# ----------------------------------------------------------------------------- pool and skip policy


def test_host_pool_ring_reuses_memory_and_applies_backpressure() -> None:
    pool = HostPool(256)
    a, b = pool.allocate(100), pool.allocate(100)
    got: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: got.append(pool.allocate(64)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got  # full: the allocation waits
    pool.release(a)
    t.join(5)
    assert got and got[0].data_ptr() == pool.buffer.data_ptr()  # reused the freed block
    pool.release(b)
    pool.release(got[0])
    assert pool.idle() and pool.in_use == 0
    with pytest.raises(CaptureError, match="does not fit"):
        pool.allocate(1000)
    pool.allocate(200)
    pool.abort("stop")
    with pytest.raises(CaptureError, match="stop"):
        pool.allocate(200)


def test_skip_policy_records_skips(tmp_path: Path) -> None:
    backend = FaultyBackend(tmp_path / "run", delay=0.05)
    model, opt, _ = make(width=256)
    refs = {}
    with deadline(60), pytest.warns(RuntimeWarning, match="skipped capturing step"):
        with dstt.Capture(backend, on_full="skip", host_buffer_bytes=64 << 10, max_chunk_bytes=4 << 10) as cap:
            for step in range(6):
                train_step(model, opt)
                if cap.snapshot(step, model=model, optimizer=opt):
                    refs[step] = reference(model, opt, None)
            skipped = list(cap.skipped)
    run = dstt.open(tmp_path / "run")
    assert skipped and run.steps() == sorted(refs)
    assert sorted(refs) + skipped != [] and set(skipped).isdisjoint(refs)
    records = skipped_steps(tmp_path / "run")
    assert sorted(records) == skipped
    assert all("staging pool full" in r["reason"] for r in records.values())
    for step, ref in refs.items():
        assert_same(ref, stored(tmp_path / "run", step), f"step {step}")


def test_default_policy_waits_instead_of_skipping(tmp_path: Path) -> None:
    backend = FaultyBackend(tmp_path / "run", delay=0.02)
    model, opt, _ = make(width=256)
    with deadline(60), dstt.Capture(backend, host_buffer_bytes=64 << 10, max_chunk_bytes=4 << 10) as cap:
        for step in range(4):
            train_step(model, opt)
            assert cap.snapshot(step, model=model, optimizer=opt)
    assert dstt.open(tmp_path / "run").steps() == [0, 1, 2, 3]
    assert skipped_steps(tmp_path / "run") == {}


# ----------------------------------------------------------------------------- failures


@pytest.mark.parametrize("exc", [OSError(errno.ENOSPC, "No space left on device"),
                                 PermissionError(errno.EACCES, "Permission denied")])
def test_background_write_failure_surfaces_naming_the_step(tmp_path: Path, exc: OSError) -> None:
    model, opt, _ = make()
    train_step(model, opt)
    probe = FaultyBackend(tmp_path / "probe")
    with dstt.Capture(probe, helper=False) as cap:
        cap.snapshot(0, model=model, optimizer=opt)
    per_step = probe.chunk_puts  # chunk writes of one full step
    backend = FaultyBackend(tmp_path / "run", fail_chunk_after=2 * per_step + 1, exc=exc)
    refs = {}
    with deadline(60):
        cap = dstt.Capture(backend, dedup=False, helper=False)  # counts chunk writes in this process
        for step in range(2):
            train_step(model, opt)
            cap.snapshot(step, model=model, optimizer=opt)
            refs[step] = reference(model, opt, None)
        cap.wait()
        train_step(model, opt)
        cap.snapshot(2, model=model, optimizer=opt)  # some of its chunks fail to write
        with pytest.raises(CaptureError, match="step 2") as info:
            cap.wait()
        assert type(exc).__name__ in str(info.value)
        train_step(model, opt)
        with pytest.raises(CaptureError, match="step 3"):
            cap.snapshot(3, model=model, optimizer=opt)
            cap.wait()
        cap.close()
    run = dstt.open(tmp_path / "run")
    assert run.steps() == [0, 1]  # nothing committed with missing data
    for step, ref in refs.items():
        assert_same(ref, stored(tmp_path / "run", step), f"step {step}")


def test_commit_failure_raised_by_next_snapshot_and_close_returns(tmp_path: Path) -> None:
    backend = FaultyBackend(tmp_path / "run", fail_commit_of=1)
    model, opt, _ = make()
    with deadline(60):
        cap = dstt.Capture(backend)
        cap.snapshot(0, model=model, optimizer=opt)
        cap.snapshot(1, model=model, optimizer=opt)
        while cap.parts.ledger.pending:  # let the failure happen in the background
            time.sleep(0.01)
        with pytest.raises(CaptureError, match="step 1.*Permission denied"):
            cap.snapshot(2, model=model, optimizer=opt)
        cap.close()  # step 2 is drained and committed; the error was already reported
        cap.close()
        with pytest.raises(CaptureError, match="closed"):
            cap.snapshot(3, model=model, optimizer=opt)
    assert dstt.open(tmp_path / "run").steps() == [0, 2]


def test_close_raises_an_unreported_failure(tmp_path: Path) -> None:
    backend = FaultyBackend(tmp_path / "run", fail_chunk_after=0)
    model, opt, _ = make()
    with deadline(60):
        cap = dstt.Capture(backend)
        cap.snapshot(0, model=model, optimizer=opt)
        with pytest.raises(CaptureError, match="step 0.*No space left"):
            cap.close()
    assert dstt.open(tmp_path / "run").steps() == []


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_capture_is_consistent(store: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 8)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    refs = {}
    with deadline(120), dstt.Capture(store) as cap:
        for step in range(4):
            x = torch.randn(32, 64, device="cuda")
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            refs[step] = clone_state(dstt.state_of(model=model, optimizer=opt, rng=False))
            cap.snapshot(step, model=model, optimizer=opt)
            model(torch.randn(32, 64, device="cuda"))  # BN buffers change right away
        assert cap.pool is not None and cap.pool.pinned
    for step, ref in refs.items():
        assert_same(ref, stored(store, step), f"step {step}")


@pytest.mark.skipif(not hasattr(os, "getpriority") or not sys.platform.startswith("linux"),
                    reason="per-thread nice values are a Linux feature")
def test_background_threads_yield_the_cpu_to_the_trainer(tmp_path: Path) -> None:
    """Stager, committer and flush threads run at the configured nice value;
    the trainer's own thread keeps its priority."""
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    model, opt, _ = make()
    with deadline(60), dstt.Capture(tmp_path / "run", background_nice=7, flush_threads=2) as cap:
        train_step(model, opt)
        cap.snapshot(0, model=model, optimizer=opt)
        cap.wait()
        threads = list(cap.parts.threads.values())
        nices = {t.name: os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threads}
    assert all(n == max(7, mine) for n in nices.values()), nices
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    with pytest.raises(ConfigError, match="background_nice"):
        dstt.Capture(tmp_path / "other", background_nice=20)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is a Linux scheduling policy")
def test_background_threads_and_helper_run_under_sched_idle(tmp_path: Path) -> None:
    """By default dstt's threads and its capture helper's threads take
    SCHED_IDLE (an OpenMP worker of the trainer preempts them at once);
    background_idle=False leaves them under the trainer's policy; the
    trainer's thread never changes, and the steps round-trip either way."""
    mine = os.sched_getscheduler(0)
    model, opt, _ = make()
    policies = {}
    for idle in (True, False):
        with deadline(60), dstt.Capture(tmp_path / f"run{idle}", background_idle=idle) as cap:
            train_step(model, opt)
            cap.snapshot(0, model=model, optimizer=opt)
            cap.wait()
            ours = {t.name: os.sched_getscheduler(t.native_id) for t in (cap.parts.threads["stager"], cap.parts.threads["committer"])}
            helper = [os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{cap.parts.helper.pid}/task")]
            policies[idle] = (ours, helper)
        assert_same(dstt.state_of(model=model, optimizer=opt, rng=False), stored(tmp_path / f"run{idle}", 0), "")
    (ours, helper), (ours_off, helper_off) = policies[True], policies[False]
    assert set(ours.values()) == {os.SCHED_IDLE} and set(helper) == {os.SCHED_IDLE}, policies
    assert set(ours_off.values()) == {mine} and set(helper_off) == {mine}, policies
    assert os.sched_getscheduler(0) == mine
    with pytest.raises(ConfigError, match="background_idle"):
        dstt.Capture(tmp_path / "other", background_idle="yes")


# ----------------------------------------------------------------------------- failures while staging


def failing_copy(step: int, index: int, lazy: bool) -> None:
    """A ``before_copy`` hook: step 0's first eager copy raises, or its first
    lazy one (after the eager blocks were handed to the flush threads)."""
    if step == 0 and (lazy or index == 0):
        raise RuntimeError("copy failed")


def test_a_staging_failure_returns_its_blocks_to_the_pool(store: Path) -> None:
    """A copy that raises fails its step only: the pool loses nothing, so
    later steps (wrapping the ring many times) and growth never hang."""
    with deadline(60), dstt.Capture(store, host_buffer_bytes=64 << 10, max_chunk_bytes=4 << 10) as cap:
        cap.before_copy = failing_copy
        cap.snapshot(0, extra={"x": torch.empty(16)}, rng=False)  # its copy raises
        with pytest.raises(CaptureError, match="step 0"):
            cap.wait()
        assert cap.pool is not None and cap.pool.idle() and cap.pool.in_use == 0
        w = torch.zeros(1024)  # 4 KiB: 40 steps wrap the 64 KiB ring several times
        for step in range(1, 41):
            assert cap.snapshot(step, extra={"w": w + step}, rng=False)
        cap.wait()
    assert dstt.open(store).steps() == list(range(1, 41))
    # the same with lazily staged optimizer state (stager thread, optimizer hook)
    model, opt, _ = make()
    with deadline(60), dstt.Capture(store.parent / "lazy", host_buffer_bytes=64 << 10,
                                    max_chunk_bytes=4 << 10) as cap:
        train_step(model, opt)
        cap.before_copy = failing_copy
        cap.snapshot(0, model=model, optimizer=opt)  # a lazy copy raises
        errors = []
        for step in range(1, 30):  # the failure surfaces at some next call; that step is still queued
            train_step(model, opt)
            try:
                cap.snapshot(step, model=model, optimizer=opt)
            except CaptureError as e:
                errors.append(str(e))
        try:
            cap.wait()
        except CaptureError as e:
            errors.append(str(e))
        assert len(errors) == 1 and "step 0" in errors[0], errors
    assert dstt.open(store.parent / "lazy").steps() == list(range(1, 30))


def test_an_interrupt_during_snapshot_is_raised_and_fails_only_that_step(store: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(step: int, index: int, lazy: bool) -> None:
        if not lazy and step == 1:
            raise KeyboardInterrupt

    with deadline(60):
        cap = dstt.Capture(store)
        cap.before_copy = interrupted  # (the stager's hook: before each copy of an eager task of step 1)
        cap.snapshot(0, extra={"w": torch.ones(3)}, rng=False)
        with pytest.raises(KeyboardInterrupt):  # not swallowed into a background failure
            cap.snapshot(1, extra={"w": torch.ones(3)}, rng=False)
        with pytest.raises(CaptureError, match="step 1 .*KeyboardInterrupt"):
            cap.wait()
        cap.snapshot(2, extra={"w": torch.ones(3)}, rng=False)
        cap.close()
    assert dstt.open(store).steps() == [0, 2]
    assert cap.pool is None


def test_a_pool_exactly_one_chunk_large_works(store: Path) -> None:
    with deadline(60), dstt.Capture(store, host_buffer_bytes=100_000, max_chunk_bytes=100_000) as cap:
        for step in range(3):
            cap.snapshot(step, extra={"w": torch.full((25_000,), float(step))}, rng=False)
    assert dstt.open(store).steps() == [0, 1, 2]


def test_skip_policy_never_blocks_on_padding_or_fragmentation(store: Path) -> None:
    """200 scalars are 800 bytes but 200 pool blocks: with 4 KiB of a slow
    step in flight they do not fit a 16 KiB pool, so the step is skipped
    at once instead of waiting for the slow write."""
    with deadline(60), dstt.Capture(store, on_full="skip", host_buffer_bytes=16 << 10,
                                    max_chunk_bytes=4 << 10) as cap:
        cap.snapshot(0, extra={"w": torch.zeros(4)}, rng=False)
        cap.wait()
        release = threading.Event()
        real = cap.writer.flush_chunk

        def slow(plan: Any, task: Any, staged: Any = None) -> Any:
            if plan.step == 1:
                release.wait(30)
            return real(plan, task, staged)

        cap.writer.flush_chunk = slow  # type: ignore[method-assign]
        cap.snapshot(1, extra={"big": torch.zeros(1024)}, rng=False)  # 4 KiB held until released
        small = {f"s{i}": torch.tensor(float(i)) for i in range(200)}
        t = time.monotonic()
        with pytest.warns(RuntimeWarning, match="skipped capturing step 2"):
            assert cap.snapshot(2, extra=small, rng=False) is False
        assert time.monotonic() - t < 5  # decided, not waited for
        release.set()
    assert dstt.open(store).steps() == [0, 1]
