"""The suite's leak check (issue 29 item 7, tests/conftest.py): a run that
leaves a file in its temporary directory fails, naming the file, even when
every test passed -- the hook on a directory of its own (quick), and a real
pytest run in a subprocess with this conftest (slow: it imports torch)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import conftest

ROOT = Path(__file__).resolve().parents[1]


def test_the_session_hook_fails_a_run_that_left_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    own = tmp_path / "run-tmp"
    (own / "dask-scratch-space").mkdir(parents=True)
    (own / "dask-scratch-space" / "global.lock").write_text("")
    (own / "empty-dir").mkdir()  # empty directories are no leak
    monkeypatch.setattr(conftest, "SUITE_TMP", own)
    monkeypatch.setattr(conftest, "SUITE_SHM", None)
    monkeypatch.setattr(conftest, "_MADE_HERE", [own])
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    session = SimpleNamespace(exitstatus=pytest.ExitCode.OK)
    conftest.pytest_sessionfinish(session, 0)  # type: ignore[arg-type]
    assert session.exitstatus == pytest.ExitCode.TESTS_FAILED
    assert "dask-scratch-space/global.lock" in capsys.readouterr().err and not own.exists()
    clean = tmp_path / "clean"
    (clean / "empty-dir").mkdir(parents=True)
    monkeypatch.setattr(conftest, "SUITE_TMP", clean)
    monkeypatch.setattr(conftest, "_MADE_HERE", [clean])
    session = SimpleNamespace(exitstatus=pytest.ExitCode.OK)
    conftest.pytest_sessionfinish(session, 0)  # type: ignore[arg-type]
    assert session.exitstatus == pytest.ExitCode.OK


@pytest.mark.slow
def test_a_run_that_leaves_a_file_in_tmp_fails(tmp_path: Path) -> None:
    (tmp_path / "test_leaky.py").write_text(
        "import os, tempfile\n"
        "def test_clean(tmp_path):\n"
        "    (tmp_path / 'fine.txt').write_text('x')\n"
        "def test_leaky():\n"
        "    open(os.path.join(tempfile.gettempdir(), 'leaked-by-a-test.txt'), 'w').close()\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DSTT_SUITE") and k not in ("TMPDIR", "PYTEST_DEBUG_TEMPROOT", "PYTEST_ADDOPTS")}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                        "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_leaky.py")],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    out = p.stdout + p.stderr
    assert "2 passed" in out, out
    assert p.returncode == 1 and "leaked-by-a-test.txt" in out and "left 1 file(s) behind" in out, out
    assert not [f for f in tmp_path.rglob("leaked-by-a-test.txt")]  # removed with the run's directory
