"""What a request asks its output to match, and its compilation into an llguidance grammar.
Needs no tokenizer, so the gateway checks a request here before it is admitted."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import llguidance

GrammarKind = Literal["json_schema", "json_object", "regex", "lark"]


class GrammarError(ValueError):
    """The grammar is invalid or uses a feature that is not supported; the message names it."""


@dataclass(frozen=True)
class GrammarSpec:
    """``value``: the JSON schema as JSON text (``json_schema``), the regex (``regex``), a grammar
    in llguidance's Lark syntax (``lark``: tool calls among text), or empty (``json_object``: any
    JSON object)."""

    kind: GrammarKind
    value: str = ""


# JSON as the model writes it: any whitespace between tokens would let a small model pad forever
_JSON_OPTIONS = {"whitespace_flexible": False}


# a marker a tool-call grammar names that is a special token in some tokenizers and text in others
# (Mistral's [TOOL_CALLS]): ``special_token`` writes it, ``compile_grammar`` resolves it per tokenizer
_SPECIAL = re.compile(r'<<special (".*?(?<!\\)") else (".*?(?<!\\)")>>')


def special_token(text: str, otherwise: str | None = None) -> str:
    """A lark item that is the special token spelled ``text`` where the tokenizer has one (llguidance's
    ``<[id]>``: that token and never text that spells it), else ``otherwise`` (lark; default the text)."""
    return f"<<special {json.dumps(text)} else {json.dumps(otherwise or json.dumps(text))}>>"


def resolve_special_tokens(lark: str, special_ids: Mapping[str, int]) -> str:
    """``lark`` with each ``special_token`` item made ``<[id]>`` or its ``otherwise``."""
    def resolve(match: re.Match) -> str:
        text = json.loads(match.group(1))
        return f"<[{special_ids[text]}]>" if text in special_ids else json.loads(match.group(2))
    return _SPECIAL.sub(resolve, lark)


def compile_grammar(spec: GrammarSpec, special_ids: Mapping[str, int] | None = None) -> str:
    """The llguidance grammar of ``spec``; raises GrammarError naming what is wrong or unsupported.
    ``special_ids``: the tokenizer's special tokens by text (None: none, as where a request is only
    checked, with no tokenizer), which ``special_token`` items of a lark grammar become."""
    if spec.kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(spec.value)
    elif spec.kind == "lark":
        grammar = llguidance.LLMatcher.grammar_from_lark(resolve_special_tokens(spec.value, special_ids or {}))
    else:
        schema = {"type": "object"} if spec.kind == "json_object" else _schema(spec.value)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except Exception as exc:  # noqa: BLE001 — llguidance raises plain exceptions for bad schemas
            raise GrammarError(str(exc)) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(error)
    return grammar


def _schema(text: str) -> dict:
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise GrammarError(f"the schema is not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise GrammarError("the schema must be a JSON object")
    return schema
