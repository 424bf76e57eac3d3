"""JSON request bodies read with bounds, so that no body can make a later reader fail with a 500.

Python's ``json`` recurses once per level, so a body nested some thousand levels deep raises
``RecursionError``, and one just under that would make every later recursive reader (pydantic, the
schema → grammar compiler, the chat template) the next place to fail. An integer of more than 4,300
digits is a ``ValueError`` that is no ``JSONDecodeError``. A ``\\ud800`` escape (a lone surrogate)
parses into a ``str`` that is no Unicode text: the tokenizer raises ``TypeError`` on it. Refusing all
of these once, where bodies are read, closes every later reader to them.
"""

from __future__ import annotations

import json
import sys

# A request's own structure is at most ~6 levels deep (body → messages → message → content →
# part → image_url); a ``response_format`` schema or a tool's ``parameters`` starts about 5 levels
# in and takes 2 levels per nested object (``properties`` → name). OpenAI's structured outputs
# allow 10 nested objects, so legitimate bodies stay under ~30 levels: 64 leaves room for
# ``anyOf``/``items``/``$defs`` on top while staying far from Python's recursion limit (1000).
MAX_JSON_DEPTH = 64
MAX_NUMBER_DIGITS = sys.get_int_max_str_digits()  # 4,300 unless the interpreter was told otherwise


class JsonRefused(ValueError):
    """A body that is JSON, but one no reader here should be handed. The message completes
    "request body …"; ``param`` is where in the body, when that is known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class JsonTooDeep(JsonRefused):
    """A JSON document nested deeper than ``max_depth`` levels (objects and arrays)."""

    def __init__(self, max_depth: int) -> None:
        super().__init__(f"is nested deeper than {max_depth} levels")
        self.max_depth = max_depth


def load_json(raw: bytes | str, max_depth: int = MAX_JSON_DEPTH, *, unicode_only: bool = True) -> object:
    """``json.loads(raw)``, raising ``JsonTooDeep`` for a document nested past ``max_depth``,
    ``JsonRefused`` for an integer Python will not read (past ``MAX_NUMBER_DIGITS``) and, with
    ``unicode_only``, for a string (or key) holding a lone surrogate; ``json.JSONDecodeError`` /
    ``UnicodeDecodeError`` for one that is not JSON, as ``json.loads``."""
    try:
        value = json.loads(raw)
    except RecursionError:  # deeper than the interpreter allows: certainly deeper than max_depth
        raise JsonTooDeep(max_depth) from None
    except ValueError as exc:
        if isinstance(exc, (json.JSONDecodeError, UnicodeDecodeError)):
            raise
        # int()'s digit limit: the one other ValueError json.loads raises
        raise JsonRefused(f"has a number of more than {MAX_NUMBER_DIGITS} digits") from None
    if (refusal := _refusal(value, max_depth, unicode_only)) is not None:
        raise refusal
    return value


def _refusal(value: object, max_depth: int, unicode_only: bool) -> JsonRefused | None:
    """Why ``value`` is refused (too deep; with ``unicode_only``, a string or key that is no
    Unicode text, named by its path, e.g. ``messages.0.content``), or None. One iterative walk, so
    that a deep value cannot overflow the stack; a node's path is kept as a link to its parent's
    and spelled out only for the error."""
    stack: list[tuple[object, int, tuple | None]] = [(value, 1, None)]  # (node, depth, (parent link, key))
    while stack:
        node, depth, link = stack.pop()
        if isinstance(node, str):
            if unicode_only and not _is_text(node):
                return _not_text("{} holds", _path(link))
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth > max_depth:
            return JsonTooDeep(max_depth)
        for key, child in node.items() if isinstance(node, dict) else enumerate(node):
            if unicode_only and isinstance(key, str) and not _is_text(key):
                return _not_text("a key in {} holds", _path(link))
            if isinstance(child, (dict, list)) or (unicode_only and isinstance(child, str)):
                stack.append((child, depth + 1, (link, key)))
    return None


def _not_text(what: str, where: str) -> JsonRefused:
    """``what`` names the string (``{}``: where it is) that holds the surrogate."""
    return JsonRefused(f"is not Unicode text: {what.format(where or 'the body')} a lone surrogate "
                       f"(\\ud800-\\udfff)", where or None)


def _path(link: tuple | None) -> str:
    """``messages.0.content`` for the link chain of that node ("" for the top level)."""
    keys = []
    while link is not None:
        link, key = link
        keys.append(str(key))
    return ".".join(reversed(keys))


def _is_text(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
