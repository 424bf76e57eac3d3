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
