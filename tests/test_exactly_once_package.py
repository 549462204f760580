"""The shape of the `resources.exactly_once` package: Dagster-free modules without an import circle, and a package
whose names, when set (as tests patch them), reach the modules that use them."""

from __future__ import annotations

import ast
from pathlib import Path

import resources.exactly_once as protocol

PACKAGE = Path(protocol.__file__).parent


def _imports(path: Path) -> list[str]:
    """Every module `path` imports, at any depth of its code."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
    return found


def test_the_package_imports_no_dagster_assets_or_orchestration() -> None:
    for path in PACKAGE.glob("*.py"):
        bad = [m for m in _imports(path) if m.split(".")[0] in ("dagster", "assets", "orchestration")]
        assert not bad, f"{path.name} imports {bad}"


def test_the_package_modules_import_each_other_without_a_circle() -> None:
    prefix = f"{protocol.__name__}."
    graph = {path.stem: {m[len(prefix):] for m in _imports(path) if m.startswith(prefix)}
             for path in PACKAGE.glob("*.py") if path.stem != "__init__"}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import circle: {' -> '.join((*path, module))}"
        if module in done:
            return
        for imported in graph.get(module, ()):
            visit(imported, (*path, module))
        done.add(module)

    for module in graph:
        visit(module, ())


def test_every_exported_name_is_there() -> None:
    missing = [name for name in protocol.__all__ if not hasattr(protocol, name)]
    assert not missing, missing
