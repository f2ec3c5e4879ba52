"""The code passes ruff (lint and format) and keeps the import layers of pyproject.toml's
contract (DESIGN.md section 2), so style and layering are enforced by `make test` and CI."""

from __future__ import annotations

import ast
import graphlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["temper", "recipes", "tests", "bench"]


def _tool(name: str) -> str:
    beside_python = Path(sys.executable).with_name(name)
    found = str(beside_python) if beside_python.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (it comes with the test extra)")
    return found


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(command):
    result = subprocess.run(
        [_tool("ruff"), *command, *TARGETS], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_imports_only_downward():
    """A module imports only its own folder and the layers below it (no ignores)."""
    result = subprocess.run(
        [_tool("lint-imports"), "--no-cache"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def _imports_of(path: Path, *, module: str, modules: set[str]) -> set[str]:
    """The temper modules a file imports (also under TYPE_CHECKING, in functions, lazily)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {name for name in names if name in modules and name != module}
    return found


def test_no_file_imports_itself_through_others():
    """No file-level import cycle in temper/ (a cycle hidden behind TYPE_CHECKING counts too):
    a type both sides need lives in the lower module."""
    paths = {}
    for path in (ROOT / "temper").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        paths[name.removesuffix(".__init__")] = path
    graph = {
        name: _imports_of(path, module=name, modules=set(paths)) for name, path in paths.items()
    }
    cycles = graphlib_cycles(graph)
    assert not cycles, cycles


def graphlib_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles graphlib's topological sort finds, one at a time (each removed edge-wise)."""
    found = []
    remaining = {node: set(edges) for node, edges in graph.items()}
    while True:
        try:
            tuple(graphlib.TopologicalSorter(remaining).static_order())
            return found
        except graphlib.CycleError as error:
            cycle = error.args[1]
            found.append(cycle)
            remaining[cycle[1]].discard(cycle[0])  # report it once, then look for others
