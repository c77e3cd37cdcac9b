"""The layers of dstt hold by themselves.

The import graph of ``dstt/`` (every ``import``, at module level or inside a
function; ``if TYPE_CHECKING:`` blocks excluded, they never run) is read
with :mod:`ast`. Each module belongs to one layer (:func:`layer_of`); an
import may only point to the same layer or a lower one, the modules never
import each other in a cycle, and the torch-free layers never import torch.
Read-only CLI commands run without importing torch (a real subprocess).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dstt

ROOT = Path(dstt.__file__).resolve().parent

#: Layers, lowest first. A module is in the first layer one of whose
#: prefixes it equals or starts with (``prefix.``); see :func:`layer_of`.
LAYERS: list[tuple[str, list[str]]] = [
    ("base", ["dstt.errors", "dstt._version", "dstt.knobs"]),
    # The format layer: everything a read-only command needs. No torch here.
    ("format", ["dstt.format"]),
    # The torch side for tensors: planning, shards, write-time stats, tensor assembly, the writer and reader.
    ("store", ["dstt.store"]),
    ("features", ["dstt.timetravel", "dstt.capture", "dstt.analysis"]),
    ("api", ["dstt.api", "dstt.integrations", "dstt"]),
    ("cli", ["dstt.cli"]),
]
TORCH_FREE = {"base", "format"}


def layer_of(module: str) -> int:
    best: tuple[int, int] | None = None  # (prefix length, layer): the longest prefix wins
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[0]):
                best = (len(p), i)
    if best is None:
        raise AssertionError(f"module {module} is in no layer: add it to LAYERS in tests/test_layers.py")
    return best[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, int]]:
    """(imported module, line) of every import that runs, TYPE_CHECKING blocks excluded."""
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
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
    """The checks above see function-level imports and skip TYPE_CHECKING ones."""
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dstt.api import Run\n"
           "def f():\n    import torch\n    from dstt.analysis import diff\n")
    got = _imports(ast.parse(src), "dstt.format.layout", False)
    assert [t for t, _ in got] == ["typing", "torch", "dstt.analysis.diff"]
    assert layer_of("dstt.analysis.diff") > layer_of("dstt.format.layout")
    assert LAYERS[layer_of("dstt.format.backends.local")][0] == "format"
    assert LAYERS[layer_of("dstt.store.reader")][0] == "store"


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
