"""Mistral's strict tool grammar names ``[TOOL_CALLS]`` as the special token it is in Mistral's
tokenizers (the token the model was trained to write), and as text in a tokenizer without it."""

from __future__ import annotations

import pytest
from test_tool_markers import byte_level_tokenizer

from shared.grammar import GrammarTable, TokenizerGrammars
from shared.grammar.spec import resolve_special_tokens, special_token
from shared.openai_api.tool_formats import FORMATS
from shared.openai_api.tools import Tool, ToolUse

WEATHER = Tool.model_validate({"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"]}}})
MISTRAL = FORMATS["mistral"]
CALL = '[{"name":"get_weather","arguments":{"city":"Oslo"}}]'


def grammars_of(special: list[str]) -> tuple[object, TokenizerGrammars]:
    tok = byte_level_tokenizer([*special, "</s>"], "</s>")
    return tok, TokenizerGrammars(tok.to_json(), 256 + len(special) + 1, [tok.special_token_id("</s>")])


def accepts(tok, grammars: TokenizerGrammars, ids: list[int]) -> bool:
    use = ToolUse([WEATHER], "auto", parallel=False, format=MISTRAL)
    table, spec = GrammarTable(grammars), use.grammar()
    for n, token in enumerate(ids):
        if not table.masks([table.sync("r", spec, ids[:n])])[0, token]:
            return False
    return table.sync("r", spec, ids).ll.is_accepting()


def test_the_marker_resolves_to_the_tokenizers_special_token_or_to_text():
    item = special_token("[TOOL_CALLS]")
    assert resolve_special_tokens(f"start: {item}", {"[TOOL_CALLS]": 7}) == "start: <[7]>"
    assert resolve_special_tokens(f"start: {item}", {}) == 'start: "[TOOL_CALLS]"'
    other = special_token("[TOOL_CALLS]", "CALL_OPEN")
    assert resolve_special_tokens(f"start: {other} {item}", {}) == 'start: CALL_OPEN "[TOOL_CALLS]"'


def test_with_the_special_token_the_call_starts_with_it_and_not_with_its_spelling():
    tok, grammars = grammars_of(["[TOOL_CALLS]", "[ARGS]"])
    marker = tok.special_token_id("[TOOL_CALLS]")
    assert grammars.special_ids["[TOOL_CALLS]"] == marker
    assert accepts(tok, grammars, [marker, *tok.encode(CALL)])
    spelled = [tok.encode(c)[0] for c in "[TOOL_CALLS]"]  # the marker spelled a byte a token
    assert not accepts(tok, grammars, [*spelled, *tok.encode(CALL)])
    assert accepts(tok, grammars, tok.encode("It is sunny."))
    assert not accepts(tok, grammars, [marker, *tok.encode('[{"name":"get_time","arguments":{}}]')])


@pytest.mark.parametrize("lead", ["", " \n"])
def test_without_the_special_token_the_marker_is_text(lead):
    tok, grammars = grammars_of([])
    assert "[TOOL_CALLS]" not in grammars.special_ids
    assert accepts(tok, grammars, tok.encode(lead + "[TOOL_CALLS]" + CALL))
    assert not accepts(tok, grammars, tok.encode(lead + "[TOOL_CALLS]" + CALL.replace("Oslo", "Paris")))
