"""docs/architecture.md's table of packages is the import graph: every import between
localserve's packages (module level or deferred into a function) is one the table lists,
and every listed one is made. Read from the source with ast, so nothing is imported."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> its installed package (pyproject's package-dir).
SOURCES = {"localserve": "localserve", "kernels": "localserve.kernels", "models": "localserve.models"}


def _unit_of(parts: list[str]) -> str | None:
    """The package (or top-level module) a dotted name under localserve belongs to."""
    return parts[1] if len(parts) > 1 and parts[0] == "localserve" else None


def actual_imports() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for folder, package in SOURCES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = package.split(".") + list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            here = parts if path.name == "__init__.py" else parts[:-1]
            unit = _unit_of(parts)
            if unit is None:
                continue
            edges.setdefault(unit, set())
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ImportFrom):
                    continue
                if node.level:
                    target = here[: len(here) - node.level + 1] + (node.module.split(".") if node.module else [])
                elif (node.module or "").split(".")[0] == "localserve":
                    target = node.module.split(".")
                else:
                    continue
                # "from .. import models" names the package in the imported names.
                names = [target[1]] if len(target) > 1 else [alias.name for alias in node.names]
                edges[unit] |= {name for name in names if name != unit and not name.startswith("__")}
    return edges


def documented_imports() -> dict[str, set[str]]:
    table = (ROOT / "docs" / "architecture.md").read_text().split("| package | what it is | imports |")[1]
    edges: dict[str, set[str]] = {}
    for line in table.split("\n\n")[0].splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        imports = set() if cells[2] == "—" else {name.strip() for name in cells[2].split(",")}
        for unit in re.findall(r"`(\w+)`", cells[0]):
            edges[unit] = imports
    return edges


def test_the_documented_table_is_the_import_graph() -> None:
    actual, documented = actual_imports(), documented_imports()
    assert set(documented) == set(actual), "every package has one row"
    wrong = {unit: (sorted(actual[unit]), sorted(documented[unit]))
             for unit in actual if actual[unit] != documented[unit]}
    assert not wrong, f"package: (imports made, imports documented): {wrong}"


def test_the_table_is_read() -> None:
    documented = documented_imports()
    assert documented["kernels"] == set() and "engine" in documented["server"]


@pytest.mark.parametrize("module", ["localserve.formats", "localserve.facts.show", "localserve.registry.pull",
                                    "localserve.cli.main", "localserve.tui.app", "localserve.bench",
                                    "localserve.server.app"])
def test_the_torch_free_side_stays_torch_free(module: str) -> None:
    code = f"import sys, {module}\nprint('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
