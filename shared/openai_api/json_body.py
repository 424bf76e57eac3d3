"""JSON request bodies read with a bound on their nesting.

Python's ``json`` recurses once per level, so a body nested some thousand levels deep raises
``RecursionError`` (a 500), and one just under that would make every later recursive reader
(pydantic, the schema → grammar compiler, the chat template) the next place to fail. Refusing
deep bodies once, where they are read, closes all of these.
"""

from __future__ import annotations

import json

# A request's own structure is at most ~6 levels deep (body → messages → message → content →
# part → image_url); a ``response_format`` schema or a tool's ``parameters`` starts about 5 levels
# in and takes 2 levels per nested object (``properties`` → name). OpenAI's structured outputs
# allow 10 nested objects, so legitimate bodies stay under ~30 levels: 64 leaves room for
# ``anyOf``/``items``/``$defs`` on top while staying far from Python's recursion limit (1000).
MAX_JSON_DEPTH = 64


class JsonTooDeep(ValueError):
    """A JSON document nested deeper than ``max_depth`` levels (objects and arrays)."""

    def __init__(self, max_depth: int) -> None:
        super().__init__(f"nested deeper than {max_depth} levels")
        self.max_depth = max_depth


def load_json(raw: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> object:
    """``json.loads(raw)``, raising ``JsonTooDeep`` for a document nested past ``max_depth``
    (``json.JSONDecodeError``/``UnicodeDecodeError`` for one that is not JSON, as ``json.loads``)."""
    try:
        value = json.loads(raw)
    except RecursionError:  # deeper than the interpreter allows: certainly deeper than max_depth
        raise JsonTooDeep(max_depth) from None
    if json_depth(value) > max_depth:
        raise JsonTooDeep(max_depth)
    return value


def json_depth(value: object) -> int:
    """Levels of nested objects and arrays in a parsed JSON value (a scalar is 0, ``{}`` is 1).
    Iterative, so that measuring a deep value cannot itself overflow the stack."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest
