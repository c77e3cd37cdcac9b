"""Scans over tensor data as tasks on an executor (issue 28): verify, diff,
run.map / history --metric and export --format zarr give exactly the
single-process answer on a real local process pool, a thread pool and a
real ``dask.distributed.LocalCluster`` with worker processes (also through
``dask://HOST:PORT``); a killed worker fails the scan with a clear error
or is retried by Dask, never a wrong answer; a Ctrl-C stops a scan
promptly and leaves nothing behind; to_dask/to_xarray read every step
exactly, on the cluster too, and a store on the local S3 server is read by
the workers with its storage_options.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import json
import math
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import s3_server

import dstt
from dstt import knobs
from dstt.errors import ConfigError, ScanError
from dstt.format.codecs import keyframes
from dstt.format.scan import forget_opened, groups_by_bytes, parse_executor, run_tasks
from dstt.format.verify import verify
from dstt.format.writeoptions import WriteOptions
from dstt.store.writer import Writer
from dstt.timetravel.zarr_export import export_zarr

DSTT_PACKING = True  # (tests/conftest.py: packs on for this module)
ROOT = Path(__file__).resolve().parents[2]


def make_store(path: str | Path, storage_options: dict[str, Any] | None = None) -> None:
    """Four steps on main and two on a branch: raw, delta-coded and packed
    chunks (several chunks per tensor), bfloat16, a scalar, an empty tensor,
    NaN and Inf values, a tensor that appears later, one that changes dtype."""
    saved = keyframes.DELTA_MAX_RATIO
    keyframes.DELTA_MAX_RATIO = math.inf  # keep every delta (random data compresses badly)
    try:
        with knobs.override(DSTT_PACK_CHUNK_BYTES="1024"):
            _write_steps(path, storage_options)
    finally:
        keyframes.DELTA_MAX_RATIO = saved


def _write_steps(path: str | Path, storage_options: dict[str, Any] | None) -> None:
    g = torch.Generator().manual_seed(28)
    w = torch.randn(64, 48, generator=g)
    emb = torch.randn(40, 16, generator=g).to(torch.bfloat16)
    opts = {"max_chunk_bytes": 4096, "storage_options": storage_options}
    with Writer(path, WriteOptions(compression="delta", keyframe_every=3, **opts)) as wr:
        for s in range(4):
            w = w + 0.01 * torch.randn(64, 48, generator=g)
            w[s, s] = float("nan") if s == 2 else w[s, s]
            state = {"model": {"w": w.clone(), "emb": (emb + s).to(torch.bfloat16), "b": torch.randn(5, generator=g),
                               "scale": torch.tensor(float(s)), "empty": torch.zeros(0, 3),
                               "ids": torch.arange(30, dtype=torch.int64) * s,
                               "mask": (torch.arange(12) % (s + 2) == 0)},
                     "optim": {"m": torch.zeros(64, 48) if s < 2 else w * 0.1, "v": torch.full((7,), math.inf)}}
            if s >= 1:
                state["model"]["late"] = torch.ones(3, 3) * s
            state["model"]["kind"] = torch.ones(4, dtype=torch.float32 if s < 3 else torch.float64)
            wr.write(s, state)
    with Writer(path, WriteOptions(branch="b", parent="main:2", **opts)) as wr:
        for s in (3, 4):
            wr.write(s, {"model": {"w": w * s, "b": torch.zeros(5), "scale": torch.tensor(-1.0),
                                   "emb": emb, "empty": torch.zeros(0, 3), "ids": torch.arange(30),
                                   "mask": torch.zeros(12, dtype=torch.bool), "late": torch.zeros(3, 3),
                                   "kind": torch.zeros(4)},
                         "optim": {"m": w, "v": torch.zeros(7)}})


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("scan") / "run"
    make_store(p)
    return p


@pytest.fixture(scope="module")
def inline(store: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every scan, run in this process: the answer the others must give."""
    got = scans(dstt.open(store), store, tmp_path_factory.mktemp("inline") / "out.zarr", executor="inline")
    assert got["verify"]["ok"] and got["verify"]["chunks"] > 20
    assert any(r["status"] == "changed" for r in got["diff 0 3"])
    assert got["export"][0]["notes"]  # 'late' and 'kind' reported
    return got


@pytest.fixture(scope="module")
def pool() -> Iterator[cf.ProcessPoolExecutor]:
    """A real local process pool (spawn), shared by the module's tests."""
    with cf.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as ex:
        yield ex


def same(a: Any, b: Any) -> bool:
    """Equal, NaN equal to NaN, floats bit for bit (repr of floats is exact)."""
    return repr(a) == repr(b)


DIFFS = [(0, 3), (1, 2), (("main", 2), ("b", 4)), (0, 0)]
METRICS = ("sparsity", "rms", "absmax", "l1", "spectral_norm", "stable_rank")


def scans(run: dstt.Run, store: Path, out: Path, metrics: tuple[str, ...] = METRICS, **where: Any) -> dict[str, Any]:
    """Every scan kind over ``store`` on one executor (``metrics``: the named metrics mapped)."""
    got: dict[str, Any] = {"verify": verify(store, **where).to_dict()}
    got["verify"].pop("store")
    for a, b in DIFFS:
        got[f"diff {a} {b}"] = run.diff(a, b, **where)
    for m in metrics:
        got[m] = run.map(m, "*", source="data", **where)
    got["history"] = run.history("model/*", "sparsity", branch="b", delta=True, **where)
    got["map fn"] = run.map(lambda t: {"sum": float(t.double().sum()), "n": t.numel()}, "model/w", **where)
    info = export_zarr(store, out, **where)
    got["export"] = (info.to_dict() | {"path": None}, zarr_arrays(out))
    return got


def zarr_arrays(out: Path) -> dict[str, Any]:
    import zarr

    g = zarr.open_group(out, mode="r")
    return {name: (a.dtype.str, a.chunks, a[...].tobytes(), dict(a.attrs)) for name, a in g.arrays()} | {
        f"{gname}/{name}": (a.dtype.str, a[...].tobytes(), dict(a.attrs))
        for gname, grp in g.groups() for name, a in grp.arrays()}


def test_every_scan_equals_the_single_process_one_on_processes_and_threads(
        store: Path, tmp_path: Path, pool: cf.ProcessPoolExecutor, inline: dict[str, Any]) -> None:
    run = dstt.open(store)
    procs = scans(run, store, tmp_path / "procs.zarr", executor=pool)
    threads = scans(run, store, tmp_path / "threads.zarr", executor="threads", workers=2)
    for key in inline:
        assert same(procs[key], inline[key]), key
        assert same(threads[key], inline[key]), key


def test_a_small_scan_with_nothing_asked_starts_no_process(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: Any, **kw: Any) -> None:
        raise AssertionError("a process pool was started")

    monkeypatch.setattr(cf, "ProcessPoolExecutor", refuse)
    run = dstt.open(store)
    assert run.diff(0, 3) and verify(store).ok and run.map("l1", "model/w")
    with pytest.raises(AssertionError, match="pool was started"):
        run.diff(0, 3, workers=2)


def _corrupt_one_chunk(store: Path) -> Path:
    files = sorted(p for p in (store / "tensors").rglob("*") if p.is_file() and p.name != "zarr.json"
                   and "model" in str(p) and p.stat().st_size > 100)
    victim = files[len(files) // 2]
    data = bytearray(victim.read_bytes())
    data[10] ^= 0xFF
    victim.write_bytes(bytes(data))
    return victim


def test_verify_reports_the_same_problems_on_a_pool(store: Path, tmp_path: Path,
                                                    pool: cf.ProcessPoolExecutor) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(store, bad)
    _corrupt_one_chunk(bad)
    inline = verify(bad, executor="inline")
    on_pool = verify(bad, executor=pool)
    assert not inline.ok and inline.problems
    assert same(on_pool.to_dict(), inline.to_dict())
    with pytest.raises(dstt.ChecksumMismatchError):
        for a, b in DIFFS:
            dstt.open(bad).diff(a, b, executor=pool)


def test_executor_names_and_task_groups() -> None:
    assert parse_executor("dask://127.0.0.1:8786") == "dask://127.0.0.1:8786"
    for bad in ("dask://", "cluster", "dask://host"):
        with pytest.raises(ConfigError):
            parse_executor(bad)
    with pytest.raises(ConfigError, match="workers"):
        run_tasks(abs, [(-1,)], workers=0)
    with knobs.override(DSTT_EXECUTOR="nonsense"), pytest.raises(ConfigError, match="nonsense"):
        run_tasks(abs, [(-1,), (2,)])
    with knobs.override(DSTT_EXECUTOR="threads"):
        assert run_tasks(abs, [(-1,), (-2,)], workers=2) == [1, 2]
    assert groups_by_bytes([5] * 8, target=100, min_groups=4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert sum(len(g) for g in groups_by_bytes([1, 50, 2, 200, 3], target=40)) == 5


def test_a_task_error_is_raised_and_the_rest_cancelled() -> None:
    """The first task error propagates as itself, tasks not started are cancelled."""
    with cf.ThreadPoolExecutor(1) as ex:
        with pytest.raises(ZeroDivisionError):
            run_tasks(divmod, [(1, 0)] + [(1, 1)] * 50, executor=ex)


INTERRUPTED = textwrap.dedent("""
    import json, multiprocessing, os, sys, time
    from dstt.timetravel import zarr_export

    REAL = zarr_export.write_chunks

    def slow(spec, root, items):
        with open(os.path.join(sys.argv[2], str(os.getpid())), "w"):
            pass
        time.sleep(0.25)
        return REAL(spec, root, items)

    if __name__ == "__main__":
        zarr_export.write_chunks = slow
        try:
            zarr_export.export_zarr(sys.argv[1], sys.argv[3], workers=2,
                                    progress=lambda done, total: print("progress", flush=True))
        except KeyboardInterrupt:
            print(json.dumps([p.pid for p in multiprocessing.active_children()]), flush=True)
            sys.exit(130)
        print("finished", flush=True)
""")


def test_ctrl_c_stops_an_export_promptly_and_leaves_nothing(store: Path, tmp_path: Path) -> None:
    """SIGINT to the whole process group (what a terminal's Ctrl-C does)
    while tasks run: the export stops within seconds, its workers are
    gone, and neither the output nor a temporary is left."""
    pids = tmp_path / "pids"
    pids.mkdir()
    out = tmp_path / "out.zarr"
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED)
    proc = subprocess.Popen([sys.executable, str(script), str(store), str(pids), str(out)], stdout=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "progress"
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        stopped_in = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, rest
    lines = [x for x in rest.splitlines() if x != "progress"]
    assert json.loads(lines[-1]) == [], "worker processes still running after the interrupt"
    assert stopped_in < 20
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
    workers = [int(p.name) for p in pids.iterdir()]
    assert workers and proc.pid not in workers
    for pid in workers:  # reaped by the pool's shutdown
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_to_dask_and_to_xarray_read_every_step_exactly(store: Path) -> None:
    """Without a cluster (dask's threads): the same values as run.read, every step."""
    pytest.importorskip("xarray")
    run = dstt.open(store)
    x = dstt.to_dask(store, "model/w", branch="b")
    steps = [s for _, ss in run.lineage("b") for s in ss]
    assert x.shape == (len(steps), 64, 48) and x.chunks[1][0] < 64  # dstt's chunks, several per step
    got = x.compute(scheduler="threads")
    for k, (b, s) in enumerate((b, s) for b, ss in run.lineage("b") for s in ss):
        assert got[k].tobytes() == run.read_array("model/w", s, branch=b).tobytes()
    emb = dstt.to_dask(store, "model/emb", steps=[1, 3]).compute(scheduler="sync")
    assert emb.dtype == np.float32 and np.array_equal(emb[1], run.read("model/emb", 3).float().numpy())
    bits = dstt.to_dask(store, "model/emb", steps=[1, 3], bits=True).compute(scheduler="sync")
    assert bits.tobytes() == np.stack([run.read_array("model/emb", s) for s in (1, 3)]).tobytes()
    da = dstt.to_xarray(store, "model/w", branch="b")
    assert list(da.step.values) == steps and list(da.branch.values) == ["main"] * 3 + ["b"] * 2
    window = np.stack([run.read_array("model/w", s, branch=b) for b, s in [("main", 1), ("main", 2)]])
    assert da.sel(step=slice(1, 2)).values.tobytes() == window.tobytes()
    assert np.allclose(da.sel(step=slice(1, 2)).std("step", skipna=False).values, window.std(axis=0), rtol=1e-3, atol=1e-6, equal_nan=True)
    ds = dstt.to_xarray(store, ["model/b", "optim/*"], steps=range(2, 4))
    assert sorted(ds.data_vars) == ["model/b", "optim/m", "optim/v"] and list(ds.step.values) == [2, 3]
    with pytest.raises(dstt.CorruptStoreError, match="kind"):
        dstt.to_dask(store, "model/kind")
    with pytest.raises(dstt.TensorNotFoundError):
        dstt.to_dask(store, "model/late")  # not at step 0
    assert dstt.to_dask(store, "model/late", steps=slice(1, None)).shape == (3, 3, 3)


def test_icechunk_export_commits_each_step_and_tags_it(store: Path, tmp_path: Path,
                                                       pool: cf.ProcessPoolExecutor) -> None:
    """One commit per step holding exactly that step's tensors, tagged
    <branch>.<step>; a branch starts at its parent's fork commit; unchanged
    chunks are not rewritten; exporting again adds only what is missing."""
    icechunk = pytest.importorskip("icechunk")
    import zarr

    from dstt.timetravel.icechunk_export import export_icechunk

    out = tmp_path / "repo"
    first = export_icechunk(store, out, branch="main", executor="inline")
    assert first.tags == ["main.0", "main.1", "main.2", "main.3"] and first.chunks_kept > 0
    second = export_icechunk(store, out, branch="b", executor=pool)
    assert second.tags == ["b.3", "b.4"] and second.skipped == ["main.0", "main.1", "main.2"]
    run = dstt.open(store)
    repo = icechunk.Repository.open(icechunk.local_filesystem_storage(str(out)))
    assert sorted(repo.list_branches()) == ["b", "main"]
    for b in ("main", "b"):
        for br, steps in run.lineage(b):
            for s in steps:
                g = zarr.open_group(repo.readonly_session(tag=f"{br}.{s}").store, mode="r")
                rec = run.record(s, branch=br)
                arrays = {n: a for n, a in g.members(max_depth=None) if isinstance(a, zarr.Array)}
                assert sorted(arrays) == sorted(rec.names), (br, s)
                for n in rec.names:
                    assert arrays[n][...].tobytes() == run.read_array(n, s, branch=br).tobytes(), (br, s, n)
    assert export_icechunk(store, out, branch="b").tags == []


def test_a_store_made_again_at_the_same_path_is_not_served_from_a_workers_cache(
        tmp_path: Path, pool: cf.ProcessPoolExecutor) -> None:
    """Workers keep stores open between tasks: a store removed and made
    again at the same path (same keys, other bytes) must be read afresh."""
    path = tmp_path / "again"
    for k in (1.0, 2.0):
        shutil.rmtree(path, ignore_errors=True)
        dstt.save(path, 0, {"w": torch.full((1000,), k)})
        assert [r["value"] for r in dstt.open(path).map("l1", "w", executor=pool)] == [1000 * k]


def cli(*args: Any) -> tuple[int, str, str]:
    from typer.testing import CliRunner

    from dstt.cli.main import app

    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.stdout + r.stderr
    return r.exit_code, r.stdout, r.stderr


def test_the_commands_take_workers_and_executor(store: Path, tmp_path: Path) -> None:
    """verify, diff, history --metric and export --format zarr|icechunk from
    the command line: the same output inline, on threads and on processes."""
    outs = {}
    for where in (["--executor", "inline"], ["--executor", "threads", "--workers", "2"]):
        rc, verify_out, _ = cli("verify", store, "--json", *where)
        assert rc == 0
        rc, diff_out, _ = cli("diff", f"{store}:0", ":3", "--json", *where)
        assert rc == 0
        rc, hist_out, _ = cli("history", f"{store}@b", "model/*", "--metric", "sparsity", "--json", *where)
        assert rc == 0, hist_out
        outs[tuple(where)] = (json.loads(verify_out) | {"store": None}, json.loads(diff_out), json.loads(hist_out))
    first = next(iter(outs.values()))
    assert all(same(v, first) for v in outs.values())
    rc, verify_out, _ = cli("verify", store, "--json", "--workers", "2")  # dstt's own process pool
    assert rc == 0 and same(json.loads(verify_out) | {"store": None}, first[0])
    series = {s["tensor"]: [p["value"] for p in s["points"]] for s in first[2]["series"]}
    assert series["model/mask"][0] == 0.5 and len(series["model/w"]) == 5  # main:0..2 then b:3, 4

    rc, out, err = cli("export", f"{store}:1", f"{store}@b:4", "--format", "zarr", "--out", tmp_path / "two.zarr",
                       "--only", "model", "--executor", "threads", "--json")
    assert rc == 0, err
    import zarr

    g = zarr.open_group(tmp_path / "two.zarr", mode="r")
    run = dstt.open(store)
    assert g["model/w"][1].tobytes() == run.read_array("model/w", 4, branch="b").tobytes()
    assert list(g["model/step"][:]) == [1, 4] and "optim" not in g
    rc, _, _ = cli("export", store, "--format", "zarr", "--steps", "1:3", "--out", tmp_path / "range.zarr")
    assert rc == 0 and list(zarr.open_group(tmp_path / "range.zarr", mode="r")["model/step"][:]) == [1, 2]
    if importlib.util.find_spec("icechunk"):
        rc, out, err = cli("export", store, "--format", "icechunk", "--out", tmp_path / "repo", "--json")
        assert rc == 0, err
        assert json.loads(out)["tags"] == ["main.0", "main.1", "main.2", "main.3"]
    for bad in (["--executor", "cluster"], ["--workers", "0"]):
        rc, out, err = cli("verify", store, *bad)
        assert rc in (1, 2) and ("executor" in err or "workers" in err), (rc, out, err)
    rc, _, err = cli("history", store, "model/w", "--metric", "entropy")
    assert rc in (1, 2) and "entropy" in err
    rc, _, err = cli("export", store, "--format", "zarr", "--out", tmp_path / "x.zarr", "--steps", "9:")
    assert rc in (1, 2) and "steps" in err
    for inside in (store, store / "x.zarr", store.parent):  # --overwrite there would remove the run
        rc, _, err = cli("export", store, "--format", "zarr", "--out", inside, "--overwrite")
        assert rc in (1, 2) and "the store" in err, err
    assert verify(store).ok


def _die_on_emb(t: torch.Tensor) -> float:
    if t.dtype == torch.bfloat16:
        os.kill(os.getpid(), signal.SIGKILL)
    return float(t.sum())


def test_a_killed_local_worker_fails_the_scan_with_a_clear_error(store: Path, pool: cf.ProcessPoolExecutor) -> None:
    """A real SIGKILL of a pool worker: ScanError naming it, no partial rows.
    (The last test of the module to use ``pool``: it breaks it.)"""
    run = dstt.open(store)
    with pytest.raises(ScanError, match="worker process died"):
        run.map(_die_on_emb, "model/*", executor=pool)


# ----------------------------------------------------------------------------- on a Dask cluster


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real LocalCluster: 2 worker processes, 1 thread each (the module's tests share it)."""
    distributed = pytest.importorskip("distributed")
    import dask

    scratch = str(tmp_path_factory.mktemp("dask"))
    # dask's scratch space (its lock files too) under the test's own directory, in this process and the
    # workers it starts: not in the run's /tmp
    with pytest.MonkeyPatch.context() as mp, dask.config.set({"temporary_directory": scratch}):
        mp.setenv("DASK_TEMPORARY_DIRECTORY", scratch)
        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                           worker_dashboard_address=None, local_directory=scratch)
        c = distributed.Client(cluster, set_as_default=False)
        try:
            yield c
        finally:
            c.run(forget_opened)
            c.close()
            cluster.close()


def test_every_scan_on_the_cluster_equals_the_single_process_one(client: Any, store: Path, tmp_path: Path,
                                                                  inline: dict[str, Any]) -> None:
    run = dstt.open(store)
    on_dask = scans(run, store, tmp_path / "dask.zarr", ("sparsity", "spectral_norm"), executor=client.get_executor())
    for key in on_dask:
        assert same(on_dask[key], inline[key]), key
    # the same through the scheduler's address, as --executor / DSTT_EXECUTOR give it
    url = "dask://" + client.scheduler.address.split("://", 1)[1]
    assert same(verify(store, executor=url).to_dict(), verify(store, executor="inline").to_dict())
    assert same(run.diff(0, 3, executor=url), inline["diff 0 3"])


def test_to_dask_and_xarray_compute_on_the_cluster(client: Any, store: Path) -> None:
    run = dstt.open(store)
    x = dstt.to_dask(store, "model/w", branch="b")
    got = client.compute(x).result(timeout=60)
    want = np.stack([run.read_array("model/w", s, branch=b) for b, ss in run.lineage("b") for s in ss])
    assert got.tobytes() == want.tobytes()
    ds = dstt.to_xarray(store, "optim/*", steps=slice(1, 4))
    mean = client.compute(ds["optim/m"].mean("step", skipna=False).data).result(timeout=60)
    m = np.stack([run.read_array("optim/m", s) for s in (1, 2, 3)])
    assert np.allclose(mean, m.mean(axis=0), rtol=1e-6, equal_nan=True)


@pytest.fixture(scope="module")
def s3() -> Iterator[s3_server.S3Server]:
    s3_server.require()
    with s3_server.serve() as server:
        yield server


def test_an_s3_store_is_read_by_the_workers_with_its_storage_options(client: Any, s3: s3_server.S3Server,
                                                                     tmp_path: Path) -> None:
    """The workers were started before the server: only the store's
    storage_options (carried by every task) tell them where it is."""
    url = s3.url()
    opts = {**s3.storage_options, "client_kwargs": {"region_name": "us-east-1"}}  # (nothing looked up elsewhere)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 48, generator=g)
    with Writer(url, WriteOptions(compression="delta", max_chunk_bytes=4096, storage_options=opts)) as wr:
        for s in range(2):
            wr.write(s, {"w": w + s * 0.01, "h": w[:8].to(torch.bfloat16)})
    run = dstt.open(url, storage_options=opts)
    x = dstt.to_dask(url, "w", storage_options=opts)
    got = client.compute(x).result(timeout=60)
    assert got.tobytes() == np.stack([run.read_array("w", s) for s in run.steps()]).tobytes()
    ex = client.get_executor()
    assert same(run.diff(0, 1, executor=ex), run.diff(0, 1, executor="inline"))
    backend = run.backend
    assert same(verify(backend, executor=ex).to_dict(), verify(backend, executor="inline").to_dict())


def _l1(t: Any) -> float:
    return float(t.double().abs().sum())


def _slow_l1(t: Any) -> float:
    time.sleep(0.25)
    return _l1(t)


def test_a_worker_killed_mid_scan_never_gives_a_wrong_answer(client: Any, store: Path) -> None:
    """SIGKILL one worker process while its tasks run: Dask retries them on
    the other (or the restarted) worker and the rows equal the
    single-process ones; if it cannot, the scan fails with ScanError.
    (The module's last test: the cluster is not waited for to heal.)"""
    run = dstt.open(store)
    names = ["model/w", "optim/*"]
    want = run.map(_l1, names, executor="inline")
    pids = list(client.run(os.getpid).values())
    started = threading.Event()
    result: dict[str, Any] = {}

    def scan() -> None:
        try:
            result["rows"] = run.map(_slow_l1, names, executor=client.get_executor(),
                                     progress=lambda n: started.set())
        except dstt.ScanError as e:
            result["error"] = e

    t = threading.Thread(target=scan)
    t.start()
    assert started.wait(60)
    os.kill(pids[0], signal.SIGKILL)
    t.join(120)
    assert not t.is_alive()
    if "error" in result:  # allowed: a clear error, never a partial answer
        assert "worker" in str(result["error"])
    else:
        assert same(result["rows"], want)
