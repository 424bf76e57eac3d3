"""What a request asks its output to match, and its compilation into an llguidance grammar.
Needs no tokenizer, so the gateway checks a request here before it is admitted."""

from __future__ import annotations

import json
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


def compile_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar of ``spec``; raises GrammarError naming what is wrong or unsupported."""
    if spec.kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(spec.value)
    elif spec.kind == "lark":
        grammar = llguidance.LLMatcher.grammar_from_lark(spec.value)
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
