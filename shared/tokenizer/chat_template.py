"""Chat templates, rendered the way transformers' ``apply_chat_template(..., tokenize=False)`` does.

Templates come from model files we did not write, so they run in jinja2's immutable sandbox. The
environment mirrors transformers': ``trim_blocks`` + ``lstrip_blocks``, the ``loopcontrols``
extension, ``raise_exception`` and ``strftime_now`` globals, and a ``tojson`` filter that does not
HTML-escape. The special token strings (``bos_token``, ``eos_token``, ...) are template variables.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# A conversation after validation: role/content are strings; other keys (name, ...) pass through.
Message = Mapping[str, object]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes (<, >, &, '), which would change what the model sees.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ChatTemplate:
    """A compiled chat template plus the special-token variables it is rendered with.

    Construction raises ``ValueError`` on a template with a syntax error; ``render`` raises
    ``ValueError`` for an invalid conversation (naming the field) or when the template itself
    rejects it (``raise_exception``)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None]):
        try:
            self._template = _compile(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ValueError(f"invalid chat template (line {exc.lineno}): {exc.message}") from exc
        self.source = source
        self._variables = {k: v for k, v in special_tokens.items() if v is not None}

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, extra_variables: Mapping[str, object] | None = None) -> str:
        """``extra_variables``: more template variables (a request's ``chat_template_kwargs``);
        one that names a variable of the template's own is a ``ValueError``."""
        conversation = validate_messages(messages)
        own = {"messages": conversation, "tools": tools, "documents": None,
               "add_generation_prompt": add_generation_prompt, **self._variables}
        taken = sorted(set(extra_variables or {}) & set(own))
        if taken:
            raise ValueError(f"chat template variables may not be set again: {', '.join(taken)}")
        try:
            return self._template.render(**(extra_variables or {}), **own)
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"chat template rejected the conversation: {exc}") from exc


def validate_messages(messages: Sequence[Message]) -> list[dict[str, object]]:
    """Check and normalise an OpenAI-style conversation into plain dicts for the template.

    Each message needs a string ``role`` and a ``content`` that is a string or a list of
    ``{"type": "text", "text": ...}`` parts (joined with newlines). Keys whose value is None are
    dropped, as transformers does. Errors are ``ValueError`` naming the field, e.g.
    ``messages[1].content``. Pydantic models are accepted (via ``model_dump``)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {role, content} objects")
    if not messages:
        raise ValueError("messages must not be empty")
    return [_validate_message(i, m) for i, m in enumerate(messages)]


def _validate_message(index: int, message: object) -> dict[str, object]:
    where = f"messages[{index}]"
    if hasattr(message, "model_dump"):
        message = message.model_dump()
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be an object with 'role' and 'content', "
                         f"got {type(message).__name__}")
    plain = {str(k): v for k, v in message.items() if v is not None}
    role = plain.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"{where}.role must be a non-empty string, got {role!r}")
    plain["content"] = _content_text(where, plain.get("content"))
    return plain


def _content_text(where: str, content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, bytes):
        return "\n".join(_text_part(f"{where}.content[{i}]", part) for i, part in enumerate(content))
    raise ValueError(f"{where}.content must be a string or a list of text parts, "
                     f"got {type(content).__name__}")


def _text_part(where: str, part: object) -> str:
    if not isinstance(part, Mapping) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        raise ValueError(f"{where} must be a {{\"type\": \"text\", \"text\": ...}} part, got {kind!r}")
    text = part.get("text")
    if not isinstance(text, str):
        raise ValueError(f"{where}.text must be a string, got {type(text).__name__}")
    return text
