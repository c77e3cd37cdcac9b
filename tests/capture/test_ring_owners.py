"""Issue 23 items 6 and 10: dstt never trusts a staging ring it cannot
prove -- neither its owner's death nor its directory's ownership.

* Item 6: every Capture swept the rings of ``/dev/shm/dstt-<uid>``
  judging owners by pid, so a trainer in another PID namespace sharing
  /dev/shm (a container with ``--ipc=host``) had its live ring deleted and
  every later step failed. Now an owner holds a lock on its ring for its
  life (ringowner.py). Tested with real PID namespaces (``unshare``, as
  root; skipped where refused): a live trainer in one keeps capturing while
  Captures and gc run outside, and the reverse; a dead trainer's ring in
  another namespace is still recovered.
* Item 10: another user could pre-create ``/dev/shm/dstt-<victim uid>``;
  every default Capture of the victim then failed. Now a ring root (or
  ring directory) that is not the user's own is never used and never
  fatal: the Capture stages in process memory, with one warning saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import bits_equal

import dstt
from dstt.capture import ring as R
from dstt.capture import ringowner as O
from dstt.errors import ConfigError, StoreLockedError
from dstt.format.localio import pid_alive

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="staging rings: Linux")


def _can_unshare() -> str | None:
    """Why a new PID namespace cannot be made here (None: it can)."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    try:
        proc = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare failed: {e}"
    return None if proc.returncode == 0 else f"unshare refused: {proc.stderr.strip()[:200]}"


NO_PIDNS = _can_unshare()
needs_pidns = pytest.mark.skipif(NO_PIDNS is not None, reason=f"needs a new PID namespace ({NO_PIDNS})")

#: A trainer capturing with the defaults (a capture helper, the ring in
#: $DSTT_SHM_DIR): each step committed before the next, so between steps
#: its ring holds no seal -- what a sweep judging by pid deleted.
TRAINER = """
import json, os, sys, time, torch, dstt
store, stop = sys.argv[1], sys.argv[2]
cap = dstt.Capture(store)
assert cap.parts.ring is not None and cap.parts.helper is not None, "no ring or no helper"
print("ring", json.dumps([str(cap.parts.ring.dir), os.getpid()]), flush=True)
w = torch.zeros(256)
step = 0
while step < 10 or not os.path.exists(stop):
    w += 1
    cap.snapshot(step, extra={"w": w}, rng=False)
    cap.wait()
    print("committed", step, flush=True)
    step += 1
    time.sleep(0.02)
cap.close()
print("done", flush=True)
"""

#: pid 1 of a new PID namespace: forks until a child gets pid TARGET (a pid
#: no process has outside), execs the command there, and exits with it.
NSINIT = """
import os, sys
target, cmd = int(sys.argv[1]), sys.argv[2:]
while True:
    pid = os.fork()
    if pid == 0:
        if os.getpid() == target:
            os.execv(cmd[0], cmd)
        os._exit(0)
    if pid == target:
        break
    os.waitpid(pid, 0)
    if pid > target:
        sys.exit(97)
code = 98
while True:
    try:
        got, status = os.wait()
    except ChildProcessError:
        break
    if got == target:
        code = os.waitstatus_to_exitcode(status)
sys.exit(code)
"""

#: What runs beside the trainer: ROUNDS rounds of Captures of another
#: store (each sweeps every ring of this user), gc of another store and of
#: the trainer's (a live writer: refused).
BESIDE = """
import sys, torch, dstt
from dstt.errors import StoreLockedError
other, trainers, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
refused = 0
for r in range(rounds):
    with dstt.Capture(other, helper=False) as cap:
        cap.snapshot(r, extra={"x": torch.ones(4)}, rng=False)
    dstt.gc(other)
    try:
        dstt.gc(trainers)
    except StoreLockedError:
        refused += 1
print(refused, flush=True)
"""
ROUNDS = 4


def free_outside_pid() -> int:
    """A pid no process of this namespace has (a trainer inside another
    namespace gets it: judged by pid from here, it is dead)."""
    for pid in range(400, 30_000):
        if not os.path.exists(f"/proc/{pid}") and not pid_alive(pid):
            return pid
    pytest.skip("no free pid below 30000")


def env_for(shm: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), O.SHM_ENV: str(shm), "OMP_NUM_THREADS": "1"}


def beside(other: Path, trainers: Path, rounds: int) -> int:
    """This process's part of BESIDE: how often gc of the trainer's store was refused."""
    refused = 0
    for r in range(rounds):
        with warnings.catch_warnings():
            warnings.simplefilter("error", O.StagingRingWarning)  # (nothing here is set aside)
            with dstt.Capture(other, helper=False) as cap:
                cap.snapshot(r, extra={"x": torch.ones(4)}, rng=False)
        dstt.gc(other)
        try:
            dstt.gc(trainers)
        except StoreLockedError:
            refused += 1
    return refused


def start_trainer(cmd: list[str], shm: Path) -> tuple[subprocess.Popen[str], dict[str, object], threading.Thread]:
    """Start a trainer; return once it committed its first step."""
    proc = subprocess.Popen(cmd, env=env_for(shm), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[str, object] = {}
    reader = threading.Thread(target=watch_trainer, args=(proc, seen), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while "last" not in seen:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the trainer never committed a step: {proc.stderr.read()[-3000:] if proc.stderr else ''}")
        time.sleep(0.05)
    return proc, seen, reader


def watch_trainer(proc: subprocess.Popen[str], seen: dict[str, object]) -> None:
    """Read the trainer's lines (its ring, its pid, its last commit)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        word, _, rest = line.strip().partition(" ")
        if word == "ring":
            seen["ring"] = json.loads(rest)
        elif word == "committed":
            seen["last"] = int(rest)


def check_trainer(proc: subprocess.Popen[str], reader: threading.Thread, store: Path, stop: Path,
                  seen: dict[str, object]) -> None:
    """Stop the trainer; every step it took committed, bit-exact."""
    stop.touch()
    try:
        proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the trainer hung")
    reader.join(timeout=30)
    err = proc.stderr.read() if proc.stderr is not None else ""
    assert proc.returncode == 0, f"the trainer failed (a step not sealed or not committed):\n{err[-3000:]}"
    steps = int(seen["last"]) + 1  # type: ignore[call-overload]
    run = dstt.open(store)
    assert steps >= 10 and run.steps() == list(range(steps))
    for step in (0, steps // 2, steps - 1):
        assert bits_equal(run.read("extra/w", step), torch.full((256,), float(step + 1)))
    assert dstt.verify(store).ok


@needs_pidns
def test_a_live_trainer_in_another_pid_namespace_keeps_its_ring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    """The trainer in a new PID namespace at a pid that is free out here
    (judged by pid, its owner is dead); out here, Captures (each sweeps)
    and gc run all along. Its ring is never deleted: every step committed."""
    shm, store, other, stop = tmp_path / "shm", tmp_path / "run", tmp_path / "other", tmp_path / "stop"
    shm.mkdir()
    monkeypatch.setenv(O.SHM_ENV, str(shm))
    target = free_outside_pid()
    proc, seen, reader = start_trainer(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", NSINIT,
                                        str(target), sys.executable, "-c", TRAINER, str(store), str(stop)], shm)
    try:
        ring_dir, pid_inside = seen["ring"]  # type: ignore[misc]
        assert pid_inside == target and not pid_alive(target)  # dead, judged by pid from out here
        refused = beside(other, store, ROUNDS)
    finally:
        check_trainer(proc, reader, store, stop, seen)
    assert refused == ROUNDS  # (a live writer holds the trainer's branch: gc refuses it)
    assert not Path(ring_dir).exists()  # closed by its trainer, at the end


@needs_pidns
def test_captures_and_gc_in_another_pid_namespace_leave_a_live_ring(tmp_path: Path) -> None:
    """The reverse: the trainer out here, Captures and gc inside a new PID
    namespace (where the trainer's pid does not exist)."""
    shm, store, other, stop = tmp_path / "shm", tmp_path / "run", tmp_path / "other", tmp_path / "stop"
    shm.mkdir()
    proc, seen, reader = start_trainer([sys.executable, "-c", TRAINER, str(store), str(stop)], shm)
    try:
        inside = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", BESIDE,
                                 str(other), str(store), str(ROUNDS)], env=env_for(shm), capture_output=True,
                                text=True, timeout=300)
    finally:
        check_trainer(proc, reader, store, stop, seen)
    assert inside.returncode == 0, inside.stderr[-3000:]
    assert int(inside.stdout) == ROUNDS


@needs_pidns
def test_a_dead_trainers_ring_from_another_pid_namespace_is_recovered(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Recovery is not lost: a trainer in a PID namespace (its helper
    killed first, then itself: step 1 stays sealed) -- its lock went with
    it, so a Capture out here proves it dead and commits step 1 bit-exact."""
    from test_seal_extents import run_killed_trainer

    shm, store, want = tmp_path / "shm", tmp_path / "run", tmp_path / "want.pt"
    shm.mkdir()
    monkeypatch.setenv(O.SHM_ENV, str(shm))
    # The trainer not pid 1 (that ignores its SIGKILL); NSINIT isolated (-I): the helper's failing-disk
    # hook would import torch into it, whose threads take the pid it waits for.
    proc = run_killed_trainer(tmp_path, store, want, env=env_for(shm),
                              prefix=("unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-I", "-c",
                                      NSINIT, "2"))
    assert proc.returncode != 0 and want.exists(), proc.stderr[-3000:]
    (ring,) = [r for g in O.groups(shm) for r in O.rings_in(g)]
    owner = json.loads((ring / "owner.json").read_text())
    assert owner["process"]["pidns"] != O.process_identity()["pidns"]
    with dstt.Capture(store, helper=False) as cap:
        assert cap.recovered == [1]
    got = dstt.open(store).state_dict(1)["model"]
    assert all(bits_equal(got[k], v) for k, v in torch.load(want).items())
    assert not ring.exists()


def test_an_owner_that_lost_its_lock_but_runs_is_not_taken_for_dead(tmp_path: Path) -> None:
    """The identity check behind the lock: a ring whose lock was closed
    (by accident) while its owner -- this process, this namespace -- runs
    is not claimed; once it gives the ring up (released), it is."""
    ring = R.Ring({"store": str(tmp_path / "s"), "branch": "main", "branch_id": 0, "branch_created": 0.0},
                  base=tmp_path)
    try:
        assert O.claim(ring.dir) is None  # locked: alive
        O.drop(ring._lock)  # the descriptor closed behind its back
        assert O.claim(ring.dir) is None  # lock free, but by its identity it runs here
        ring._lock = O.hold(ring.dir)
        ring.release()
        c = O.claim(ring.dir)
        assert c is not None and c.owner is not None and c.owner["pid"] == os.getpid()
        c.close()
    finally:
        shutil.rmtree(ring.dir, ignore_errors=True)


def test_a_ring_of_an_older_dstt_is_never_touched(tmp_path: Path) -> None:
    """No lock file (an older dstt's ring, judged by pid then): nothing
    proves its owner gone -- never deleted, adopted or set aside."""
    store = tmp_path / "run"
    dstt.save(store, 0, {"w": torch.ones(2)})
    url = str(dstt.open(store).backend.url)
    group = R.group_dir(url, "main", tmp_path / "shm")
    ring = group / "999999-0123456789ab"
    ring.mkdir(mode=0o700, parents=True)
    for d in (group.parent, group):
        d.chmod(0o700)
    (ring / "owner.json").write_text(json.dumps({"store": url, "branch": "main", "pid": 999999}))
    (ring / f"seal-{1:020d}.json").write_text("{}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert R.sweep(tmp_path / "shm") == 0
        assert O.claim(ring) is None
    assert sorted(p.name for p in ring.iterdir()) == ["owner.json", f"seal-{1:020d}.json"]


# ----------------------------------------------------------------------------- item 10


def _chown_or_skip(path: Path, uid: int) -> None:
    try:
        os.chown(path, uid, -1)
    except PermissionError:
        pytest.skip("chown to another user refused here (not root)")


@pytest.mark.parametrize("case", ["another user's", "world-writable", "a file", "a symlink", "a group dir"])
def test_a_ring_root_that_is_not_ours_is_never_used_and_never_fatal(tmp_path: Path, case: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``/dev/shm/dstt-<uid>`` made by another user (or open to others, a
    file, a symlink -- even to a private directory of ours -- or a ring
    directory under it open to others): Capture stages in process memory
    with one warning saying why, commits every step, writes nothing there;
    gc works; shm=True is refused up front. (Before: every Capture failed.)"""
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv(O.SHM_ENV, str(shm))
    root = O.ring_root()
    store = tmp_path / "run"
    why = {"another user's": "belongs to uid 65534", "world-writable": "mode 777", "a file": "not a directory",
           "a symlink": "symbolic link", "a group dir": "mode 755"}[case]
    watched = root
    if case == "another user's":
        root.mkdir(mode=0o700)
        _chown_or_skip(root, 65534)
    elif case == "world-writable":
        root.mkdir()
        root.chmod(0o777)
    elif case == "a file":
        root.write_bytes(b"")
    elif case == "a symlink":
        mine = tmp_path / "mine"
        mine.mkdir(mode=0o700)
        root.symlink_to(mine)
        watched = mine
    else:
        root.mkdir(mode=0o700)
        dstt.save(store, 0, {"w": torch.zeros(2)})
        watched = R.group_dir(str(dstt.open(store).backend.url), "main")
        watched.mkdir(mode=0o755)
        watched.chmod(0o755)
    before = sorted(os.listdir(watched)) if watched.is_dir() else None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with dstt.Capture(store) as cap:
            assert cap.parts.ring is None and cap.parts.helper is None  # in process memory
            for step in range(1, 4):
                cap.snapshot(step, extra={"w": torch.full((64,), float(step))}, rng=False)
        dstt.gc(store)
    ours = [str(w.message) for w in seen if issubclass(w.category, O.StagingRingWarning)]
    assert len(ours) == 1 and why in ours[0] and "process memory" in ours[0], ours
    run = dstt.open(store)
    assert run.steps()[-3:] == [1, 2, 3] and bits_equal(run.read("extra/w", 3), torch.full((64,), 3.0))
    assert (sorted(os.listdir(watched)) if watched.is_dir() else None) == before  # nothing written there
    with pytest.raises(ConfigError, match=why):
        dstt.Capture(store, shm=True)


def test_a_ring_root_made_by_another_user_is_never_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What another user puts under a root they made is never judged,
    adopted or removed (their rings are theirs), by Capture nor by gc."""
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv(O.SHM_ENV, str(shm))
    store = tmp_path / "run"
    dstt.save(store, 0, {"w": torch.zeros(2)})
    root = O.ring_root()
    group = R.group_dir(str(dstt.open(store).backend.url), "main")
    ring = group / "999999-0123456789ab"
    ring.mkdir(mode=0o700, parents=True)
    (ring / "owner.json").write_text("{}")
    (ring / "owner.lock").touch()
    for d in (root, group, ring):
        d.chmod(0o700)
    _chown_or_skip(root, 65534)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with dstt.Capture(store, helper=False):
            pass
        dstt.gc(store)
    assert sorted(p.name for p in ring.iterdir()) == ["owner.json", "owner.lock"]
    assert sorted(os.listdir(root)) == [group.name]



# ----------------------------------------------------------------------------- the slow campaign

#: A trainer that resumes its store: each step's tensor is a function of the
#: step; "sealed K" once K is sealed in the ring (wait_staged): from then on
#: K must be committed, whatever is killed.
CAMPAIGN_TRAINER = """
import os, sys, time, torch, dstt
store = sys.argv[1]
cap = dstt.Capture(store)
start = max(dstt.open(store).steps(), default=-1) + 1
print("start", start, flush=True)
step = start
while True:
    cap.snapshot(step, extra={"w": torch.full((4096,), float(step + 1))}, rng=False)
    cap.wait_staged()
    print("sealed", step, flush=True)
    step += 1
    time.sleep(0.005)
"""


def _namespace_init(unshare_pid: int) -> int | None:
    """The pid (here) of pid 1 of the namespace ``unshare --fork`` made."""
    try:
        kids = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children").read_text().split()
    except OSError:
        return None
    return int(kids[0]) if kids else None


@pytest.mark.slow
@needs_pidns
def test_sigkill_rounds_in_pid_namespaces_lose_no_sealed_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """Rounds of: a trainer (with its helper) in a new PID namespace, at a
    pid free out here, SIGKILLed whole (pid 1 of the namespace: every process in it) after a
    random delay, while Captures and gc of another store sweep out here;
    the next round's trainer recovers. Every step reported sealed is
    committed, steps are 0..n without a gap, each bit-exact; verify clean."""
    import random

    shm, store = tmp_path / "shm", tmp_path / "run"
    shm.mkdir()
    monkeypatch.setenv(O.SHM_ENV, str(shm))
    rnd = random.Random(23)
    sealed: set[int] = set()
    rounds = 16
    for r in range(rounds):
        target = str(free_outside_pid())  # (judged by pid from out here, the trainer is dead)
        proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", NSINIT, target,
                                 sys.executable, "-c", CAMPAIGN_TRAINER, str(store)], env=env_for(shm),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: list[str] = []

        def read(p: subprocess.Popen[str] = proc, out: list[str] = lines) -> None:
            assert p.stdout is not None
            out.extend(p.stdout)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + 120
        while not any(x.startswith("sealed") for x in lines):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"round {r}: no step sealed: {proc.stderr.read()[-3000:] if proc.stderr else ''}")
            time.sleep(0.02)
        beside(tmp_path / f"other{r}", store, 1)  # sweeps out here while it runs
        time.sleep(rnd.uniform(0.0, 0.6))
        init = _namespace_init(proc.pid)
        assert init is not None
        os.kill(init, signal.SIGKILL)  # the namespace ends: trainer and helper die at once
        proc.wait(timeout=60)
        reader.join(timeout=30)
        sealed.update(int(x.split()[1]) for x in lines if x.startswith("sealed"))
    with dstt.Capture(store, helper=False):  # the last round's sealed steps
        pass
    steps = dstt.open(store).steps()
    assert sealed <= set(steps), sorted(sealed - set(steps))  # 0 steps lost that were reported sealed
    assert steps == list(range(len(steps)))
    run = dstt.open(store)
    for step in steps:
        assert bits_equal(run.read("extra/w", step), torch.full((4096,), float(step + 1))), step
    assert dstt.verify(store).ok
    assert not [x for g in O.groups(shm) for x in O.rings_in(g)]
    print(f"{rounds} rounds, {len(steps)} steps compared bit-exact, {len(sealed)} reported sealed")


#: A trainer killed while making its ring: the ring and its lock exist, its
#: owner.json does not yet (nothing can have been sealed in it).
_DIES_MAKING_ITS_RING = """
import os, sys
from dstt.capture import ring as R
ring = R.Ring({"store": sys.argv[1], "branch": "main", "branch_id": 0, "branch_created": float(sys.argv[2])})
os.unlink(ring.dir / "owner.json")
print(ring.dir, flush=True)
os._exit(0)  # the kernel drops its lock, as at a SIGKILL
"""


def test_a_ring_whose_owner_died_making_it_is_removed_not_set_aside(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer killed between making its ring and writing owner.json left
    a ring nothing was ever sealed in: the next Capture removes it quietly
    (it used to set it aside, with a warning, for a person to remove)."""
    shm, store = tmp_path / "shm", tmp_path / "run"
    shm.mkdir()
    monkeypatch.setenv(O.SHM_ENV, str(shm))
    dstt.save(store, 0, {"w": torch.ones(2)})
    run = dstt.open(store)
    from dstt.format.root import load_branch

    url, created = str(run.backend.url), load_branch(run.backend, "main").created
    out = subprocess.run([sys.executable, "-c", _DIES_MAKING_ITS_RING, url, repr(created)], env=env_for(shm),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    ring = Path(out.stdout.strip())
    assert ring.is_dir() and not (ring / "owner.json").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error", O.StagingRingWarning)
        with dstt.Capture(store, helper=False) as cap:
            cap.snapshot(1, extra={"w": torch.zeros(2)}, rng=False)
    assert not ring.exists()
    assert not (O.ring_root(shm) / O.SET_ASIDE_DIR).exists()
    assert dstt.open(store).steps() == [0, 1]
