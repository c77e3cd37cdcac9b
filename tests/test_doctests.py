"""Every docstring example in the package runs and prints what it shows."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import tempfile
from pathlib import Path

import pytest

import dstt

MODULES = sorted(m.name for m in pkgutil.walk_packages(dstt.__path__, "dstt."))
#: Modules that import an optional extra: skipped where it is not installed.
OPTIONAL = {"dstt.integrations.transformers": "transformers", "dstt.integrations.lightning": "lightning"}


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if name in OPTIONAL:
        pytest.importorskip(OPTIONAL[name])
    # The examples make their stores with tempfile.mkdtemp(): under this test's own
    # directory (removed with it), never in the run's /tmp
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
