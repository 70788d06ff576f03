"""The house rules of ``src/ljperf``, read from the source (no import of ljperf): layers whose imports point
downward only, no import cycle, lazy imports only where they defer torch, short functions, no ``unittest.mock``.

Run: ``.venv/bin/python -m pytest tests/test_layout.py`` (a second); docs/architecture.md draws the same layers.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("__main__",),
    ("cli",),
    ("commands",),
    ("ablation",),
    ("benchmark", "plan", "doctor", "comm", "startup_hooks"),
    ("speed",),
    ("recompute", "engines"),
    ("forecast", "compile"),
    ("checkpoint",),
    ("run",),
    ("models", "distributed"),
    ("core",),
    ("__init__",),
)
"""Top to bottom: a module may import its own package and packages of the layers below its own, nothing else
(``ljperf/__init__.py`` is the version, at the bottom; ``cli`` is the dispatcher, at the top)."""

HEAVY = frozenset({"torch", "transformers", "deepspeed", "accelerate", "matplotlib"})
"""Third-party packages whose import takes seconds: the only reason for an import inside a function."""

LONGEST_FUNCTION = 80
AT_EVERY_START = frozenset({"ljperf.startup_hooks.post_import"})
"""What ``ljperf_startup.pth`` loads in every Python process while a hook's variable is set: it imports ``sys``
alone (each module more costs every ``python``, ``pip`` and tool start), the rest when a hook acts."""


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    line: int
    lazy: bool
    """Inside a function, not at module level."""
    typing_only: bool
    """Under ``if TYPE_CHECKING:``."""


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_unit(module: str) -> str:
    """The name ``LAYERS`` knows a module by: its package under ljperf, or the top-level module's own name."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def rank(unit: str) -> int:
    return next(i for i, units in enumerate(LAYERS) if unit in units)


def _imports_of(tree: ast.Module, importer: str, modules: set[str]) -> list[Import]:
    found: list[Import] = []

    def visit(node: ast.AST, *, lazy: bool, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner_lazy = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            inner_typing = typing_only or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
            if isinstance(child, ast.Import):
                found.extend(Import(importer, a.name, child.lineno, lazy, typing_only) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                for alias in child.names:  # ``from ljperf.core import hardware`` imports a module
                    sub = f"{child.module}.{alias.name}"
                    target = sub if sub in modules else child.module
                    found.append(Import(importer, target, child.lineno, lazy, typing_only))
            visit(child, lazy=inner_lazy, typing_only=inner_typing)

    visit(tree, lazy=False, typing_only=False)
    return found


def read_tree(root: Path) -> tuple[dict[str, ast.Module], list[Import]]:
    paths = sorted((root / "ljperf").rglob("*.py"))
    trees = {module_name(p, root): ast.parse(p.read_text(), filename=str(p)) for p in paths}
    imports = [i for name, tree in trees.items() for i in _imports_of(tree, name, set(trees))]
    return trees, imports


def upward(imports: list[Import]) -> list[str]:
    """Imports of ljperf modules that point sideways or up a layer."""
    bad = []
    for i in imports:
        if not i.target.startswith("ljperf"):
            continue
        mine, theirs = layer_unit(i.importer), layer_unit(i.target)
        if mine != theirs and rank(theirs) <= rank(mine):
            bad.append(f"{i.importer}:{i.line} imports {i.target} ({mine} may not import {theirs})")
    return bad


def cycles(imports: list[Import], modules: set[str]) -> list[list[str]]:
    """Strongly connected groups of modules (every kind of import counts: lazy and typing-only hide a cycle, they
    do not remove it); a package's ``__init__`` does not count as importing its own modules."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for i in imports:
        if i.target in modules and i.target != i.importer and not i.importer.startswith(i.target + "."):
            graph[i.importer].add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def heavy_modules(imports: list[Import], modules: set[str]) -> set[str]:
    """ljperf modules whose import (at module level, through other ljperf modules) imports a ``HEAVY`` package."""
    eager = [i for i in imports if not i.lazy and not i.typing_only]
    heavy = {i.importer for i in eager if i.target.split(".")[0] in HEAVY}
    grew = True
    while grew:
        more = {i.importer for i in eager if i.target in heavy} - heavy
        heavy |= more
        grew = bool(more)
    return heavy & modules


def needless_lazy(imports: list[Import], modules: set[str]) -> list[str]:
    """Imports of ljperf modules inside functions that defer nothing: the target is light, or the importer is
    heavy already."""
    heavy = heavy_modules(imports, modules)
    return [
        f"{i.importer}:{i.line} imports {i.target} inside a function"
        for i in imports
        if i.lazy
        and i.target in modules
        and (i.target not in heavy or i.importer in heavy)
        and i.importer not in AT_EVERY_START
    ]


def long_functions(trees: dict[str, ast.Module]) -> list[str]:
    return [
        f"{name}:{node.lineno} {node.name} is {node.end_lineno - node.lineno + 1} lines"
        for name, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION
    ]


@pytest.fixture(scope="module")
def source() -> tuple[dict[str, ast.Module], list[Import]]:
    return read_tree(SRC)


def test_every_package_has_a_layer_and_a_docstring(source):
    trees, _ = source
    units = {layer_unit(name) for name in trees}
    assert units <= {u for layer in LAYERS for u in layer}, units - {u for layer in LAYERS for u in layer}
    assert [name for name, tree in trees.items() if not ast.get_docstring(tree)] == []


def test_imports_point_downward_only(source):
    _, imports = source
    assert upward(imports) == []


def test_no_import_cycle_between_modules(source):
    trees, imports = source
    assert cycles(imports, set(trees)) == []


def test_imports_inside_functions_only_defer_heavy_packages(source):
    trees, imports = source
    assert needless_lazy(imports, set(trees)) == []
    at_start = [i.target for i in imports if i.importer in AT_EVERY_START and not i.lazy and not i.typing_only]
    assert at_start == ["sys"]
    # --help of every command answers without them: each command module is light
    heavy = heavy_modules(imports, set(trees))
    assert sorted(m for m in trees if m.startswith("ljperf.commands") or m == "ljperf.cli") == sorted(
        m for m in trees if (m.startswith("ljperf.commands") or m == "ljperf.cli") and m not in heavy
    )


def test_functions_are_short_and_no_mock_in_src(source):
    trees, imports = source
    assert long_functions(trees) == []
    assert [i for i in imports if i.target.startswith("unittest")] == []


def test_the_checks_find_a_planted_upward_import_a_cycle_and_a_needless_lazy_import(tmp_path):
    """The rules above on a small planted tree: each breach is found."""
    pkg = tmp_path / "ljperf"
    for folder in ("core", "models", "engines"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text('"""x."""\n')
    (pkg / "__init__.py").write_text('"""x."""\n')
    (pkg / "core" / "units.py").write_text('"""x."""\nfrom ljperf.models import spec\n')  # upward
    (pkg / "models" / "spec.py").write_text('"""x."""\nfrom ljperf.models import build\n')
    (pkg / "models" / "build.py").write_text('"""x."""\ndef f():\n    from ljperf.models import spec\n')  # cycle
    (pkg / "engines" / "base.py").write_text('"""x."""\ndef f():\n    from ljperf.core import units\n')  # light
    trees, imports = read_tree(tmp_path)
    assert upward(imports) == ["ljperf.core.units:2 imports ljperf.models.spec (core may not import models)"]
    assert cycles(imports, set(trees)) == [["ljperf.models.build", "ljperf.models.spec"]]
    assert "ljperf.engines.base:3 imports ljperf.core.units inside a function" in needless_lazy(imports, set(trees))


def test_ruff_lints_every_python_file_of_src_tests_and_benchmarks():
    """ruff's default ``exclude`` skips folders named like build outputs (``dist``, ``build``, ``venv``): a package
    so named is never linted. Every ``.py`` the repository keeps must be in ruff's own list of what it checks."""
    root = SRC.parent
    shown = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", "."], cwd=root, capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr
    linted = {Path(line.strip()).resolve() for line in shown.stdout.splitlines() if line.strip().endswith(".py")}
    kept = {p.resolve() for folder in ("src", "tests", "benchmarks") for p in (root / folder).rglob("*.py")}
    assert sorted(str(p.relative_to(root)) for p in kept - linted) == []
