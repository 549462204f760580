"""The shape of the product code, measured: lines per module, the longest functions, import circles, imports
hidden inside functions, changelog-style comments and the README's size.

`python -m bench.shape` prints the table; `--json` prints the same figures for a script. `tests/test_shape.py`
holds the code to the limits below, so `make lint` fails when a module or a function outgrows them.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import tokenize
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("orchestration", "assets", "resources")
MODULE_LIMIT = 600
FUNCTION_LIMIT = 80
# The warm run launcher is one subsystem kept whole on purpose: its docstring is its design, its private Dagster
# imports sit in one block.
MODULE_LIMIT_EXEMPT = {"orchestration/launcher.py"}
# A function-level import is allowed where a comment on it (or the line above) says it keeps start-up fast.
STARTUP_NOTE = re.compile(r"start-?up", re.IGNORECASE)
CHANGELOG = re.compile(r"found by (review|a review)|CI caught|before this release|last release"
                       r"|(?<![.\w])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"  # a commit hash
                       r"|\b\d+(\.\d+)?\s?%")


@dataclass
class Function:
    where: str
    name: str
    lines: int


@dataclass
class Shape:
    modules: dict[str, int] = field(default_factory=dict)
    functions: list[Function] = field(default_factory=list)
    circles: list[list[str]] = field(default_factory=list)
    hidden_imports: list[str] = field(default_factory=list)
    changelog_comments: list[str] = field(default_factory=list)
    readme_bytes: int = 0


def product_files(root: Path = ROOT) -> Iterator[Path]:
    for top in PRODUCT:
        yield from sorted((root / top).rglob("*.py"))


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def functions(tree: ast.AST, where: str) -> Iterator[Function]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield Function(where, node.name, (node.end_lineno or node.lineno) - node.lineno + 1)


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


Enclosing = ast.FunctionDef | ast.AsyncFunctionDef | None


def imports(tree: ast.Module, module: str, is_package: bool) -> Iterator[tuple[str, ast.stmt, Enclosing]]:
    """(imported module, statement, the function it sits in or None) for each import outside `if TYPE_CHECKING:`
    blocks."""
    def visit(node: ast.AST, function: Enclosing) -> Iterator[tuple[str, ast.stmt, Enclosing]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, child, function
            elif isinstance(child, ast.ImportFrom):
                base = _absolute(child, module, is_package)
                yield base, child, function
                for alias in child.names:  # `from package import module`
                    yield f"{base}.{alias.name}", child, function
            else:
                inner = child if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
                yield from visit(child, inner)
    yield from visit(tree, None)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    anchor = parts if is_package else parts[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def comments(source: str) -> Iterator[tuple[int, str]]:
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(found)


def _is_ancestor(package: str, module: str) -> bool:
    return module.startswith(package + ".")


def measure(root: Path = ROOT) -> Shape:
    shape = Shape(readme_bytes=(root / "README.md").stat().st_size)
    graph: dict[str, set[str]] = {}
    names = {module_name(p, root) for p in product_files(root)}
    for path in product_files(root):
        rel = str(path.relative_to(root))
        source = path.read_text()
        lines = source.splitlines()
        shape.modules[rel] = len(lines)
        tree = ast.parse(source)
        shape.functions.extend(functions(tree, rel))
        module = module_name(path, root)
        edges = graph.setdefault(module, set())
        for target, stmt, function in imports(tree, module, path.name == "__init__.py"):
            # A package's own modules importing through the package (its `__init__` re-exports) is not a circle
            # of concepts; a package importing its own module is how packages work.
            if target in names and target != module and not _is_ancestor(target, module) \
                    and not _is_ancestor(module, target):
                edges.add(target)
            if function is not None and target.split(".")[0] in PRODUCT + ("dagster", "pyspark", "confluent_kafka") \
                    and not _noted(lines, stmt, function):
                shape.hidden_imports.append(f"{rel}:{stmt.lineno}")
        shape.changelog_comments.extend(f"{rel}:{n}: {text.strip()}" for n, text in comments(source)
                                        if CHANGELOG.search(text))
    shape.functions.sort(key=lambda f: -f.lines)
    shape.circles = circles(graph)
    shape.hidden_imports = sorted(set(shape.hidden_imports))
    return shape


def _noted(lines: list[str], stmt: ast.stmt, function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """True if the import's own lines, the three lines above it or its function's docstring name start-up time."""
    first = max(stmt.lineno - 4, 0)
    return any(STARTUP_NOTE.search(line) for line in lines[first: stmt.end_lineno or stmt.lineno]) or bool(
        STARTUP_NOTE.search(ast.get_docstring(function) or ""))


def over_limits(shape: Shape) -> list[str]:
    problems = [f"{m}: {n} lines (limit {MODULE_LIMIT})" for m, n in shape.modules.items()
                if n > MODULE_LIMIT and m not in MODULE_LIMIT_EXEMPT]
    problems += [f"{f.where}: {f.name}() is {f.lines} lines (limit {FUNCTION_LIMIT})" for f in shape.functions
                 if f.lines > FUNCTION_LIMIT and f.where not in MODULE_LIMIT_EXEMPT]
    problems += [f"import circle: {' <-> '.join(c)}" for c in shape.circles]
    problems += [f"{where}: import inside a function without a start-up note" for where in shape.hidden_imports]
    problems += [f"changelog-style comment: {c}" for c in shape.changelog_comments]
    return problems


def table(shape: Shape, top: int = 12) -> str:
    total = sum(shape.modules.values())
    biggest = sorted(shape.modules.items(), key=lambda kv: -kv[1])
    out = [f"product code: {total} lines in {len(shape.modules)} modules; README {shape.readme_bytes:,} bytes", "",
           f"{'module':<44} lines"]
    out += [f"{m:<44} {n:>5}" for m, n in biggest[:top]]
    over = [f for f in shape.functions if f.lines > FUNCTION_LIMIT]
    out += ["", f"functions over {FUNCTION_LIMIT} lines: {len(over)} (longest first)"]
    out += [f"  {f.lines:>4}  {f.where}:{f.name}" for f in over[:top]]
    out += ["", f"modules over {MODULE_LIMIT} lines: "
            f"{sum(1 for n in shape.modules.values() if n > MODULE_LIMIT)}",
            f"import circles: {len(shape.circles)}"]
    out += [f"  {' <-> '.join(c)}" for c in shape.circles]
    out += [f"imports inside functions (no start-up note): {len(shape.hidden_imports)}",
            f"changelog-style comments: {len(shape.changelog_comments)}"]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    shape = measure()
    if args.json:
        print(json.dumps(asdict(shape), indent=2))
    else:
        print(table(shape))


if __name__ == "__main__":
    main()
