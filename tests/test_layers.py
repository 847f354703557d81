"""The house's layers, read from the source: phalanx-core at the bottom
imports neither the registry nor a plugin (its testing kit included), and
no package has an import circle among its modules (an import anywhere in a
module counts: at the top, under ``TYPE_CHECKING``, or inside a function).
A package's ``__init__`` re-exports its modules, so imports of a package's
root are left out of the circles."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "phalanx_core": ROOT / "core" / "src" / "phalanx_core",
    "phalanx": ROOT / "registry" / "src" / "phalanx",
    **{
        f"phalanx_{p.name}": p / "src" / f"phalanx_{p.name}"
        for p in sorted((ROOT / "plugins").iterdir())
        if (p / "src" / f"phalanx_{p.name}").is_dir()
    },
}


def modules(package: str) -> dict[str, Path]:
    folder = PACKAGES[package]
    found = {}
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).with_suffix("").parts
        name = ".".join((package, *parts)).removesuffix(".__init__")
        found[name] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module of ``known`` that ``name`` (at ``path``) imports."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        found.update(t for t in targets if t in known)
    return found


def circles(package: str) -> list[list[str]]:
    known = modules(package)
    edges = {
        name: {t for t in imports(name, path, set(known)) if t != package}
        for name, path in known.items()
        if name != package
    }
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_circles(package):
    assert circles(package) == [], f"import circles in {package}"


def test_core_reaches_no_package_above_it():
    above = {name for name in PACKAGES if name != "phalanx_core"}
    reaching = {}
    for name, path in modules("phalanx_core").items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                targets = [node.module or ""]
            else:
                continue
            hits = sorted({t for t in targets if t.split(".")[0] in above})
            if hits:
                reaching.setdefault(name, []).extend(hits)
    assert reaching == {}, f"phalanx-core imports packages above it: {reaching}"
