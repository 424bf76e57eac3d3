"""The layers import downward only: ``kernels`` imports nothing of ours, ``shared`` (the library)
imports ``kernels`` and itself but never ``services`` (the application) or ``loadtest``, and
``services`` never imports ``loadtest``. Imports inside functions count too."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("kernels", "shared", "services", "loadtest")
ALLOWED = {
    "kernels": {"kernels"},
    "shared": {"kernels", "shared"},
    "services": {"kernels", "shared", "services"},
}


def imported_packages(path: Path) -> set[tuple[str, int]]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update((name.split(".")[0], node.lineno) for name in names if name.split(".")[0] in OURS)
    return found


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_layer_imports_only_the_layers_below_it(layer):
    upward = [f"{path.relative_to(ROOT)}:{line} imports {top}"
              for path in sorted((ROOT / layer).rglob("*.py"))
              for top, line in imported_packages(path) if top not in ALLOWED[layer]]
    assert upward == []


def test_the_check_sees_an_upward_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from services.stack.stack import Stack\n    import loadtest.tools\n")
    assert imported_packages(module) == {("services", 2), ("loadtest", 3)}


# Packages import one another one way only: no package-level circle under services/ or loadtest/.
# A package is a directory with __init__.py, holding its modules and (one level up) its sub-packages:
# at each depth every package is taken with all below it, so loadtest/tools/client_compat importing
# loadtest.bench while loadtest.bench imports loadtest.tools is a circle of tools and bench.
CIRCLE_ROOTS = ("services", "loadtest")

def package_of(module: str, root: Path = ROOT) -> str | None:
    """The package a dotted name is or lives in; None if it is neither a package nor a module."""
    path = root.joinpath(*module.split("."))
    if (path / "__init__.py").exists():
        return module
    return module.rpartition(".")[0] if path.with_suffix(".py").exists() else None


def imported_modules(path: Path, root: Path = ROOT) -> set[tuple[str, int]]:
    """The modules and packages a file imports, at the top or inside functions (``from a import b``:
    ``a.b`` where that is a module or package, else ``a``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add((name if package_of(name, root) else node.module, node.lineno))
    return found


def package_imports(top: str, root: Path = ROOT) -> dict[tuple[str, str], str]:
    """(importing package, imported package) under ``top`` → where the first such import is."""
    edges: dict[tuple[str, str], str] = {}
    for path in sorted((root / top).rglob("*.py")):
        where = path.relative_to(root)
        source = ".".join(where.parent.parts)
        for name, line in sorted(imported_modules(path, root)):
            target = package_of(name, root) if name.split(".")[0] == top else None
            if target and target != source:
                edges.setdefault((source, target), f"{where}:{line}")
    return edges


def circles(edges: dict[tuple[str, str], str]) -> list[str]:
    """Every import that closes a circle, at any depth: ``a -> b (file:line)``."""
    found = []
    for depth in range(1, 1 + max((p.count(".") + 1 for pair in edges for p in pair), default=0)):
        graph: dict[str, set[str]] = {}
        where = {}
        for (a, b), place in edges.items():
            a, b = (".".join(p.split(".")[:depth]) for p in (a, b))
            if a != b:
                graph.setdefault(a, set()).add(b)
                where.setdefault((a, b), place)
        found += [f"{a} -> {b} ({place})" for (a, b), place in sorted(where.items()) if a in reachable(graph, b)]
    return sorted(set(found))


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize("top", CIRCLE_ROOTS)
def test_packages_import_one_another_one_way_only(top):
    assert circles(package_imports(top)) == []


def test_the_check_sees_a_circle_through_a_lazy_import_in_a_sub_package(tmp_path):
    for package in ("top", "top/bench", "top/tools", "top/tools/compat"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "top/tools/stats.py").write_text("")
    (tmp_path / "top/bench/serving.py").write_text("from top.tools import stats\n")
    (tmp_path / "top/tools/compat/run.py").write_text("def f():\n    from top.bench.serving import up\n")
    assert circles(package_imports("top", tmp_path)) == [
        "top.bench -> top.tools (top/bench/serving.py:1)", "top.tools -> top.bench (top/tools/compat/run.py:2)"]
