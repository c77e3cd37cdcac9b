"""dstt against a real S3-compatible server (moto in server mode on
127.0.0.1, tests/s3_server.py): the backend contract, atomic branch locks and
branch ids under racing writers, no stale listings in a long-lived process,
and save / Capture / ls / diff / history / verify / export / branch / prune /
gc on ``s3://`` URLs. Skipped only where moto or s3fs is not installed."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest
import s3_server
import torch
from s3_server import S3Server
from typer.testing import CliRunner

import dstt
from dstt.cli.main import app
from dstt.errors import CorruptStoreError, StoreLockedError
from dstt.format.backends import Backend
from dstt.testing.backends import BackendTests

runner = CliRunner()


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    s3_server.require()
    with s3_server.serve() as server:
        yield server


def _backend(url: str):  # type: ignore[no-untyped-def]
    from dstt.format.backends import open_backend

    return open_backend(url, create=True)


class TestS3Backend(BackendTests):
    """The backend contract dstt ships, on a real S3-compatible server."""

    @pytest.fixture
    def backend(self, s3: S3Server) -> Iterator[Backend]:
        b = _backend(s3.url())
        yield b
        b.close()


def test_backend_contract(s3: S3Server) -> None:
    b = _backend(s3.url())
    assert b.get("a/b") is None and not b.exists("a/b") and b.list_dir("") == []
    b.put("a/b", [b"he", memoryview(b"llo")])
    b.put_atomic("a/c/d", b"x" * 10)
    assert b.get("a/b") == b"hello" and b.get_range("a/b", 1, 3) == b"ell" and b.size("a/c/d") == 10
    assert b.exists("a/b") and not b.exists("a") and not b.exists("a/c")  # prefixes are not objects
    assert b.list_dir("") == ["a"] and b.list_dir("a") == ["b", "c"] and b.list_dir("a/c") == ["d"]
    assert b.list_prefix("a") == ["a/b", "a/c/d"] and b.list_dir("nope") == []
    assert b.put_if_absent("a/b", b"other") is False and b.get("a/b") == b"hello"
    assert b.put_if_absent("a/new", b"1") is True
    assert b.get_many(["a/b", "a/missing", "a/new"]) == [b"hello", None, b"1"]
    with pytest.raises(CorruptStoreError):
        b.get("a/c/d", max_bytes=9)
    assert b.get("a/c/d", max_bytes=10) == b"x" * 10
    assert b.put_if_unchanged("a/new", b"1", b"2") and not b.put_if_unchanged("a/new", b"1", b"3")
    assert b.get("a/new") == b"2"
    b.delete("a/b")
    b.delete("a/b")  # idempotent
    b.delete_prefix("a/c")
    assert b.list_prefix("") == ["a/new"]
    with pytest.raises(CorruptStoreError):
        b.get("../escape")


def _race(n_threads: int, attempt) -> list[int]:  # type: ignore[no-untyped-def]
    """Start ``attempt(i)`` on n threads at once; indices of those that won."""
    barrier = threading.Barrier(n_threads)
    won: list[int] = []
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            if attempt(i):
                won.append(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return won


def test_racing_writers_never_both_get_the_branch_lock(s3: S3Server) -> None:
    """Many rounds of writers taking the same branch lock at once: exactly
    one wins each round (the lock is one conditional create on the server)."""
    from dstt.format.lock import BranchLock

    url = s3.url()
    b = _backend(url)
    for rnd in range(25):
        locks = [BranchLock(b, f"b{rnd}") for _ in range(4)]
        won = _race(4, lambda i: locks[i].try_acquire())
        assert len(won) == 1, f"round {rnd}: {len(won)} writers hold the lock"
        locks[won[0]].release()


def test_expired_lease_is_taken_over_by_exactly_one_writer(s3: S3Server) -> None:
    """A dead writer's expired lease, four writers taking it over at once:
    one wins (the takeover replaces the lease only if unchanged, If-Match);
    "delete, then create" let a slower writer delete the winner's new lease."""
    from dstt.format import layout as L
    from dstt.format.lock import BranchLock

    b = _backend(s3.url())
    for rnd in range(10):
        name = f"e{rnd}"
        dead = {"branch": name, "pid": 1, "host": "gone", "since": 0.0, "expires": 1.0, "token": "dead"}
        b.put(L.lock_key(name), json.dumps(dead).encode())
        locks = [BranchLock(b, name) for _ in range(4)]
        won = _race(4, lambda i: locks[i].try_acquire())
        assert len(won) == 1, f"round {rnd}: {len(won)} writers took over the lease"
        locks[won[0]].release()


def test_concurrent_branches_get_distinct_ids(s3: S3Server) -> None:
    url = s3.url()
    dstt.save(url, 0, {"w": torch.zeros(3)})
    from dstt.format.backends import open_backend
    from dstt.format.root import create_branch, load_branch

    def make(i: int) -> bool:
        create_branch(open_backend(url), f"f{i}", ("main", 0))
        return True

    assert len(_race(4, make)) == 4
    b = open_backend(url)
    ids = [load_branch(b, f"f{i}").id for i in range(4)] + [load_branch(b, "main").id]
    assert len(set(ids)) == 5


def test_lock_refused_where_the_store_ignores_conditional_creates(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that answers a conditional create of an existing key with
    success is refused at lock time, with a one-line reason."""
    from dstt.format.backends import objectstore
    from dstt.format.backends.objectstore import FsspecBackend
    from dstt.format.lock import acquire

    url = s3.url()
    b = FsspecBackend(url, {"endpoint_url": s3.endpoint, "anon": False, "config_kwargs": {"retries": {"max_attempts": 2}}})
    real = b.fs.pipe_file

    def ignores_condition(path, value, mode="overwrite", **kw):  # type: ignore[no-untyped-def]
        return real(path, value, **kw)  # drops mode="create", like a store without If-None-Match

    monkeypatch.setattr(b.fs, "pipe_file", ignores_condition)
    monkeypatch.setattr(objectstore, "_ATOMIC_CHECKED", {})
    with pytest.raises(StoreLockedError, match="conditional create"):
        acquire(b, "main")


def test_long_lived_process_sees_other_writers_steps(s3: S3Server) -> None:
    """This process lists a store, another process commits steps 1-2, then
    this process writes step 3: it sees steps 1-2 (no stale listing), uses a
    fresh slot (step 1's data intact) and verify finds nothing wrong."""
    url = s3.url()
    dstt.save(url, 0, {"w": torch.zeros(1000)})
    run = dstt.open(url)
    assert run.steps() == [0]
    code = (f"import torch, dstt\nfor s in (1, 2):\n"
            f"    dstt.save({url!r}, s, {{'w': torch.full((1000,), float(s))}})\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=s3.subprocess_env(), timeout=120)
    assert run.steps() == [0, 1, 2]
    dstt.save(url, 3, {"w": torch.full((1000,), 3.0)})
    run2 = dstt.open(url)
    assert [float(run2.read("w", s)[0]) for s in range(4)] == [0.0, 1.0, 2.0, 3.0]
    from dstt.format.verify import verify

    report = verify(url)
    assert report.ok, report


def _train_into(url: str, steps: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with dstt.Capture(url, every=1) as cap:
        for step in range(steps):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            cap.snapshot(step, model=model, optimizer=opt)
    return model


def test_capture_and_cli_on_s3(s3: S3Server, tmp_path: Path) -> None:
    url = s3.url()
    model = _train_into(url)
    run = dstt.open(url)
    assert run.steps() == [0, 1, 2, 3]
    assert torch.equal(run.state_dict(3)["model"]["0.weight"], model[0].weight)

    def cli(*args: str) -> str:
        r = runner.invoke(app, list(args))
        assert r.exit_code == 0, (args, r.output)
        return r.stdout

    listing = json.loads(cli("ls", url, "--json"))
    assert [s["step"] for s in listing["branches"][0]["steps"]] == [0, 1, 2, 3]
    assert json.loads(cli("ls", f"{url}:2", "--json"))["tensors"]
    diff = json.loads(cli("diff", f"{url}:0", ":3", "--json"))
    assert any(r["status"] == "changed" for r in diff["tensors"])
    hist = json.loads(cli("history", url, "model/0.weight", "--json"))
    assert [p["step"] for p in hist["series"][0]["points"]] == [0, 1, 2, 3]
    assert json.loads(cli("verify", url, "--json"))["ok"]
    out = tmp_path / "s.pt"
    cli("export", f"{url}:3", "--out", str(out), "-q")
    assert torch.equal(torch.load(out)["model"]["0.weight"], model[0].weight)
    cli("branch", url, "alt", "--from", ":1")
    dstt.save(f"{url}", 10, {"w": torch.ones(2)}, branch="alt")
    assert dstt.open(url).steps("alt") == [10]
    cli("prune", url, "--keep-last", "1", "--branch", "main")
    assert dstt.open(url).steps("main") == [1, 3]  # the fork point is kept
    gc = json.loads(cli("gc", url, "--json"))
    assert gc["chunks_removed"] > 0
    assert json.loads(cli("verify", url, "--json"))["ok"]
    assert torch.equal(dstt.open(url).state_dict(3)["model"]["0.weight"], model[0].weight)


def test_cli_subprocess_uses_standard_environment(s3: S3Server) -> None:
    """A new user's `dstt ls s3://...`: endpoint and credentials only from
    AWS_ENDPOINT_URL / AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY; the read
    path imports neither torch nor zarr."""
    url = s3.url()
    dstt.save(url, 0, {"w": torch.ones(2)})
    code = (f"import sys\nfrom dstt.cli.main import main\nsys.argv = ['dstt', 'ls', {url!r}, '--json']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules and 'zarr' not in sys.modules, 'the read path imported torch/zarr'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=s3.subprocess_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["branches"][0]["steps"][0]["step"] == 0
    missing = subprocess.run([sys.executable, "-m", "dstt.cli.main", "ls", f"s3://{s3.new_bucket()}/none"],
                             capture_output=True, text=True, env=s3.subprocess_env(), timeout=120)
    assert missing.returncode == 1 and "no store" in missing.stderr and "Traceback" not in missing.stderr


def test_storage_options_reach_fsspec(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Endpoint and credentials given only as storage_options (no env)."""
    from s3fs import S3FileSystem

    for k in s3.env:
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    S3FileSystem.clear_instance_cache()
    url = s3.url()
    opts = dict(s3.storage_options, client_kwargs={"region_name": "us-east-1"})
    dstt.save(url, 0, {"w": torch.arange(3.0)}, storage_options=opts)
    assert dstt.open(url, storage_options=opts).steps() == [0]
    model = torch.nn.Linear(2, 2)
    with dstt.Capture(url, storage_options=opts, branch="cap") as cap:
        cap.snapshot(0, model=model)
    fresh = torch.nn.Linear(2, 2)
    dstt.restore(f"{url}@cap:0", model=fresh, storage_options=opts)
    assert torch.equal(fresh.weight, model.weight)
    S3FileSystem.clear_instance_cache()


_HOLD_LEASE = r"""
import sys
from dstt.format.backends import open_backend
from dstt.format.lock import acquire
lock = acquire(open_backend(sys.argv[1]), "main", ttl=600)
print("held", flush=True)
sys.stdin.readline()
"""


def _lease_holder(s3: S3Server, url: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_LEASE, url], env=s3.subprocess_env(), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held", proc.communicate()
    return proc


def test_a_lease_whose_holder_died_on_this_host_is_stale_not_a_live_writer(s3: S3Server) -> None:
    """Issue 23 (13): `dstt unlock` on an S3 lease whose holder is dead on
    this host (same host, boot and PID namespace; pid gone) called it "the
    live writer" (and refused without --force); a new writer waited for the
    lease to expire (600 s here). A stopped holder is still alive: refused."""
    import os
    import signal

    from dstt.format.lock import acquire, lock_holder

    url = s3.url()
    dstt.save(url, 0, {"w": torch.ones(2)})
    proc = _lease_holder(s3, url)
    try:
        os.kill(proc.pid, signal.SIGSTOP)  # alive, not renewing: its lease is unexpired (ttl 600 s)
        r = runner.invoke(app, ["unlock", f"{url}@main"])
        assert r.exit_code == 1 and "live writer" in r.output and f"pid {proc.pid}" in r.output, r.output
    finally:
        proc.kill()
        proc.wait()
    assert lock_holder(url, "main") is None  # dead on this host: stale, not a holder
    r = runner.invoke(app, ["unlock", f"{url}@main"])  # no --force needed
    assert r.exit_code == 0, r.output
    assert "stale: its holder is gone" in r.output and f"pid {proc.pid}" in r.output and "live" not in r.output
    proc = _lease_holder(s3, url)
    proc.kill()
    proc.wait()
    r = runner.invoke(app, ["unlock", "--force", "--json", f"{url}@main"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["broken"] and not doc["was_held"] and doc["holder_gone"] and doc["holder"]["pid"] == proc.pid
    proc = _lease_holder(s3, url)
    proc.kill()
    proc.wait()
    acquire(url, "main").release()  # a dead holder's unexpired lease is taken over at once
    dstt.save(url, 1, {"w": torch.zeros(2)})
    assert dstt.open(url).steps() == [0, 1]


@pytest.mark.parametrize("client", ["obstore", "fsspec"])
def test_both_object_clients_keep_the_contract(s3: S3Server, monkeypatch: pytest.MonkeyPatch, client: str) -> None:
    """obstore (the default where installed) and fsspec/s3fs (DSTT_OBJECT_CLIENT=fsspec)
    serve s3:// alike: the backend contract and the branch-lock race."""
    monkeypatch.setenv("DSTT_OBJECT_CLIENT", client)
    assert type(_backend(s3.url())).__name__ == {"obstore": "ObstoreBackend", "fsspec": "FsspecBackend"}[client]
    test_backend_contract(s3)
    test_racing_writers_never_both_get_the_branch_lock(s3)
