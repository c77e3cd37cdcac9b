"""The layers of dstt hold by themselves.

The import graph of ``dstt/`` (every ``import``, at module level, inside a
function or under ``if TYPE_CHECKING:`` -- a type-only import is an edge
too: a cycle hidden there is still a cycle) is read with :mod:`ast`. Each module belongs to one layer (:func:`layer_of`); an
import may only point to the same layer or a lower one, the modules never
import each other in a cycle, and the torch-free layers never import torch.
Read-only CLI commands run without importing torch (a real subprocess).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dstt

ROOT = Path(dstt.__file__).resolve().parent

#: Layers, lowest first: each a list of folders (``dstt/format/``: every
#: module below it) and single modules (``dstt.errors``). No catch-all: a new
#: module is in a layer only if its folder or its name is listed here
#: (:func:`layer_of`).
LAYERS: list[tuple[str, list[str]]] = [
    ("base", ["dstt.errors", "dstt._version", "dstt.knobs"]),
    # The format layer: everything a read-only command needs. No torch here.
    ("format", ["dstt/format/"]),
    # The torch side for tensors: planning, shards, write-time stats, tensor assembly, the writer and reader.
    ("store", ["dstt/store/"]),
    ("features", ["dstt/timetravel/", "dstt/capture/", "dstt/analysis/"]),
    ("api", ["dstt.api", "dstt/integrations/", "dstt"]),
    ("cli", ["dstt/cli/"]),
    # The contract suites shipped with the package (pytest classes an outside implementation subclasses).
    ("testing", ["dstt/testing/"]),
]
TORCH_FREE = {"base", "format"}


def layer_of(module: str) -> int:
    """The layer of ``module``: the one listing it, or its folder (the
    deepest folder listed wins)."""
    best: tuple[int, int] | None = None  # (depth of the folder, layer)
    for i, (_, entries) in enumerate(LAYERS):
        for e in entries:
            if e.endswith("/"):
                pkg = e.rstrip("/").replace("/", ".")
                if (module == pkg or module.startswith(pkg + ".")) and (best is None or len(pkg) > best[0]):
                    best = (len(pkg), i)
            elif module == e:
                return i
    if best is None:
        raise AssertionError(f"module {module} is in no layer: add it (or its folder) to LAYERS in tests/test_layers.py")
    return best[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, int]]:
    """(imported module, line) of every import, TYPE_CHECKING blocks included."""
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            out.extend((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{target}.{a.name}"
                out.append((sub if sub in ALL_MODULES else target, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


ALL_MODULES = {module_name(p) for p in ROOT.rglob("*.py")}


def graph() -> dict[str, list[tuple[str, int]]]:
    g = {}
    for path in sorted(ROOT.rglob("*.py")):
        mod = module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        g[mod] = _imports(tree, mod, path.name == "__init__.py")
    return g


def test_every_module_has_a_layer() -> None:
    for mod in ALL_MODULES:
        layer_of(mod)


def test_no_import_points_up() -> None:
    bad = []
    for mod, imports in graph().items():
        for target, line in imports:
            if target.split(".")[0] != "dstt":
                continue
            if layer_of(target) > layer_of(mod):
                bad.append(f"{mod}:{line} imports {target} "
                           f"({LAYERS[layer_of(mod)][0]} -> {LAYERS[layer_of(target)][0]})")
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(sorted(bad))


def test_torch_free_layers_never_import_torch() -> None:
    bad = [f"{mod}:{line} imports {target}" for mod, imports in graph().items()
           if LAYERS[layer_of(mod)][0] in TORCH_FREE
           for target, line in imports if target == "torch" or target.startswith("torch.")]
    assert not bad, "torch imported in the torch-free format layer:\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    g = {m: sorted({t for t, _ in imps if t in ALL_MODULES and t != m}) for m, imps in graph().items()}
    # Tarjan's strongly connected components: any component of two or more is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, []):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            connect(v)
    assert not cycles, f"import cycles: {cycles}"


def test_layer_rules_catch_violations() -> None:
    """The checks above see function-level and TYPE_CHECKING imports."""
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dstt.api import Run\n"
           "def f():\n    import torch\n    from dstt.analysis import diff\n")
    got = _imports(ast.parse(src), "dstt.format.layout", False)
    assert [t for t, _ in got] == ["typing", "dstt.api", "torch", "dstt.analysis.diff"]
    assert layer_of("dstt.analysis.diff") > layer_of("dstt.format.layout")
    assert LAYERS[layer_of("dstt.format.backends.local")][0] == "format"
    assert LAYERS[layer_of("dstt.store.reader")][0] == "store"
    assert LAYERS[layer_of("dstt")][0] == "api"
    with pytest.raises(AssertionError, match="in no layer"):  # no catch-all: a new folder must be listed
        layer_of("dstt.newfolder.mod")


# ----------------------------------------------------------------------------- store keys

#: What a store key looks like: under one of the format's top-level
#: prefixes, or naming one of its documents (a whole string, or the text
#: part of an f-string).
_KEY_RE = re.compile(r"^(meta|tensors|packs)/|(^|/)(zarr|commit|index|names|rank-fail)\.json$|(^|/)stats\.npy$"
                     r"|/rank-$")


def key_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every string in code (docstrings excepted) that looks
    like a store key or a part of one."""
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return sorted((n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
            and _KEY_RE.search(n.value))


def test_store_keys_are_built_in_the_format_layer() -> None:
    """Every store key and document name is the format layer's
    (dstt.format.layout and the modules beside it): no module above it
    spells one."""
    bad = [f"{mod}:{line} {text!r}" for mod, _, tree in _sources() if not mod.startswith("dstt.format")
           for line, text in key_literals(tree)]
    assert not bad, "store key literals outside dstt/format (build them there):\n" + "\n".join(bad)


def test_store_key_rule_catches_violations() -> None:
    src = ('"""meta/steps in a docstring is fine."""\nk = f"meta/steps/{b}"\nj = f"{p}/zarr.json"\n'
           'r = f"{d}/rank-{r:05d}.json"\nok = "metadata/x"\nn = "stats.npy"\n')
    assert [line for line, _ in key_literals(ast.parse(src))] == [2, 3, 4, 6]


# ----------------------------------------------------------------------------- types


#: Modules on pyproject.toml's mypy not-yet list (not strict yet) at most:
#: lower it as modules leave the list, never raise it.
MYPY_NOT_YET_MAX = 0


def test_mypy_not_yet_list_only_shrinks() -> None:
    """mypy is strict on every module but those of the not-yet list, which
    names existing modules above the store layer and only shrinks."""
    import tomllib

    conf = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["mypy"]
    assert conf["strict"] is True and conf["files"] == ["dstt"]
    not_yet = [m for o in conf.get("overrides", []) if o.get("ignore_errors") for m in o["module"]]
    assert len(not_yet) <= MYPY_NOT_YET_MAX, f"the not-yet list grew to {len(not_yet)}: make the new module strict"
    assert not (set(not_yet) - ALL_MODULES), f"not-yet list names no module: {sorted(set(not_yet) - ALL_MODULES)}"
    low = [m for m in not_yet if LAYERS[layer_of(m)][0] in ("base", "format", "store")]
    assert not low, f"base, format and store are strict without exception: {low}"


# ----------------------------------------------------------------------------- torch-free CLI


_PROBE = """
import json, sys
from dstt.cli.main import main
sys.argv = ["dstt", *json.loads(sys.argv[1])]
try:
    main()
except SystemExit as e:
    code = e.code
else:
    code = 0
heavy = sorted(m for m in ("torch", "zarr", "numcodecs") if m in sys.modules)
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


@pytest.fixture(scope="module")
def small_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("layers") / "run"
    for s in range(3):
        dstt.save(path, s, {"model": {"w": torch.full((4,), float(s)), "b": torch.zeros(2)}})
    return path


@pytest.mark.parametrize("args", [
    ["--help"], ["ls", "{s}", "--json"], ["ls", "{s}:latest", "--json"],
    ["history", "{s}", "model/w", "--json"], ["find", "{s}", "--json"], ["ls", "{s}"],
])
def test_read_only_commands_do_not_import_torch(small_store: Path, args: list[str]) -> None:
    argv = [a.format(s=small_store) for a in args]
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent)}
    p = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argv)], capture_output=True, text=True,
                       env=env, timeout=120)
    report = json.loads(p.stderr.strip().splitlines()[-1])
    assert report["code"] in (0, None), (argv, p.stdout, p.stderr)
    assert report["heavy"] == [], f"dstt {' '.join(argv)} imported {report['heavy']}"
    if "--json" in argv:
        doc = json.loads(p.stdout)
        assert doc  # real output, e.g. the store's branches or the history series
        if argv[0] == "history":
            assert [pt["value"] for pt in doc["series"][0]["points"]] == [0.0, 2.0, 4.0]  # norms of full(4, s)


def test_importing_dstt_is_torch_free() -> None:
    code = "import sys, dstt; dstt.StepRef; dstt.ChecksumMismatchError; print('torch' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT.parent)}, timeout=120)
    assert p.stdout.strip() == "False", p.stderr


# ----------------------------------------------------------------------------- settings and warnings


def _sources() -> list[tuple[str, Path, ast.AST]]:
    return [(module_name(p), p, ast.parse(p.read_text(), str(p))) for p in sorted(ROOT.rglob("*.py"))]


def _is_os_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ"
            and isinstance(node.value, ast.Name) and node.value.id == "os")


def environ_reads(tree: ast.AST) -> list[int]:
    """Lines reading the environment: ``os.environ.get(..)``, ``os.environ[..]``
    (not an assignment to it), ``os.getenv(..)``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                (node.func.attr == "get" and _is_os_environ(node.func.value))
                or (node.func.attr == "getenv" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "os")):
            out.append(node.lineno)
        elif isinstance(node, ast.Subscript) and _is_os_environ(node.value) and isinstance(node.ctx, ast.Load):
            out.append(node.lineno)
    return out


def test_settings_are_read_through_knobs() -> None:
    """Every ``DSTT_*`` setting is read in dstt.knobs, when used (never at
    import, never anywhere else): no other module reads the environment."""
    bad = [f"{mod}:{line}" for mod, _, tree in _sources() if mod != "dstt.knobs" for line in environ_reads(tree)]
    assert not bad, "environment read outside dstt.knobs (add an accessor there):\n" + "\n".join(bad)


def _dstt_warnings() -> set[str]:
    import dstt.errors as E
    return {n for n, c in vars(E).items() if isinstance(c, type) and issubclass(c, E.DsttWarning)}


def warn_categories(tree: ast.AST) -> list[tuple[int, str | None]]:
    """(line, category name or None) of every ``warnings.warn(..)`` / ``warn(..)`` call."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if not ((isinstance(f, ast.Attribute) and f.attr == "warn" and isinstance(f.value, ast.Name)
                 and f.value.id == "warnings") or (isinstance(f, ast.Name) and f.id == "warn")):
            continue
        cat = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "category"),
                                                            None)
        name = cat.id if isinstance(cat, ast.Name) else cat.attr if isinstance(cat, ast.Attribute) else None
        out.append((node.lineno, name))
    return out


#: Modules that still warn with a builtin category: may only shrink (each
#: gets a DsttWarning subclass from dstt.errors).
WARNS_NOT_YET: set[str] = set()


def test_every_warning_is_a_dstt_warning() -> None:
    """What dstt warns about is a DsttWarning subclass (dstt.errors), so a
    user can filter dstt's warnings, all or one kind."""
    ours = _dstt_warnings()
    bad, still = [], set()
    for mod, _, tree in _sources():
        if mod != "dstt.errors":  # (a warning class of its own elsewhere would pass by its name)
            bad += [f"{mod}:{c.lineno} defines warning class {c.name} (put it in dstt.errors)"
                    for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and any(
                        isinstance(b, ast.Name) and b.id.endswith("Warning") for b in c.bases)]
        for line, cat in warn_categories(tree):
            if cat not in ours:
                if mod in WARNS_NOT_YET:
                    still.add(mod)
                else:
                    bad.append(f"{mod}:{line} warns with {cat or 'UserWarning (no category)'}")
    assert not bad, "a warning that is no DsttWarning:\n" + "\n".join(bad)
    assert still == WARNS_NOT_YET, f"clean now, take them off WARNS_NOT_YET: {sorted(WARNS_NOT_YET - still)}"


def test_settings_and_warning_rules_catch_violations() -> None:
    src = ("import os, warnings\nx = os.environ.get('DSTT_X')\ny = os.environ['DSTT_Y']\nos.environ['A'] = '1'\n"
           "z = os.getenv('B')\nwarnings.warn('w', RuntimeWarning)\nwarnings.warn('v')\n"
           "warnings.warn('u', category=SkippedStepWarning)\n")
    tree = ast.parse(src)
    assert environ_reads(tree) == [2, 3, 5]
    assert warn_categories(tree) == [(6, "RuntimeWarning"), (7, None), (8, "SkippedStepWarning")]
    assert "SkippedStepWarning" in _dstt_warnings() and "RuntimeWarning" not in _dstt_warnings()
