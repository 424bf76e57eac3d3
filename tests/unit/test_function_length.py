"""No function or method in ``shared``, ``services`` or ``loadtest`` runs over 60 lines, counted from its
``def`` line to its last line (decorators excluded): a longer one is split into functions that each say
one thing. ``kernels`` is not checked."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("shared", "services", "loadtest")
MAX_LINES = 60
# (path, function name) allowed over the limit: none
ALLOWED: set[tuple[str, str]] = set()


def long_functions(path: Path, root: Path = ROOT) -> list[tuple[str, str, int, int]]:
    """(path relative to ``root``, name, def line, length) of every function and method in ``path``
    over ``MAX_LINES`` lines."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_LINES:
                found.append((path.relative_to(root).as_posix(), node.name, node.lineno, length))
    return found


def test_no_function_runs_over_60_lines():
    too_long = [f"{rel}:{line} {name}: {length} lines"
                for layer in CHECKED for path in sorted((ROOT / layer).rglob("*.py"))
                for rel, name, line, length in long_functions(path) if (rel, name) not in ALLOWED]
    assert too_long == []


def test_the_check_sees_a_long_function(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
    source = tmp_path / "pkg" / "mod.py"
    source.parent.mkdir()
    source.write_text("import functools\n\n\n@functools.cache\ndef long():\n" + body
                      + "\n\nclass C:\n    async def short(self):\n        return 1\n\n"
                      + "    def also_long(self):\n" + body.replace("    ", "        "))
    assert long_functions(source, tmp_path) == [("pkg/mod.py", "long", 5, MAX_LINES + 1),
                                                ("pkg/mod.py", "also_long", 72, MAX_LINES + 1)]


def test_a_function_of_exactly_60_lines_passes(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("def fits():\n" + "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES - 1)))
    assert long_functions(source, tmp_path) == []
