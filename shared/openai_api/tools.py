"""Tool calls: the tools in the prompt, the grammar that forces a call, and calls read back from
the model's text.

The model writes a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the
Hermes/Qwen convention, which chat templates with tool support render too). A template that does
not know tools gets them in a system message that asks for that form. ``tool_choice: required``
or a named function is enforced by a grammar: the output is then a JSON list of calls (one call
for a named function, or without ``parallel_tool_calls``), whose items are the functions'
``{"name", "arguments"}`` schemas.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from shared.protocol.generate import GrammarSpec

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDef(_Body):
    name: StrictStr = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: StrictStr | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: StrictBool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: StrictStr


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class ToolCallFunction(_Body):
    name: StrictStr
    arguments: StrictStr


class ToolCall(_Body):
    id: StrictStr
    type: Literal["function"] = "function"
    function: ToolCallFunction


def system_prompt(tools: list[Tool]) -> str:
    specs = "\n".join(json.dumps(t.function.model_dump(exclude_none=True)) for t in tools)
    return ("You may call functions. Their signatures:\n" + specs + "\nTo call one, reply with "
            f'{CALL_OPEN}{{"name": <function name>, "arguments": <arguments object>}}{CALL_CLOSE}.')


def render_call(call: ToolCall) -> str:
    """An earlier call of the conversation, as the model would have written it."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    return CALL_OPEN + json.dumps({"name": call.function.name, "arguments": arguments}) + CALL_CLOSE


def forced_grammar(tools: list[Tool], choice: ToolChoice | None, parallel: bool) -> GrammarSpec | None:
    """The grammar of a forced call (``required`` or a named function); None when the model may
    answer in text."""
    if choice == "required":
        chosen = tools
    elif isinstance(choice, NamedToolChoice):  # one call of that function, as OpenAI makes
        chosen, parallel = [t for t in tools if t.function.name == choice.function.name], False
    else:
        return None
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters}}
             for t in chosen]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": item, "minItems": 1, **({} if parallel else {"maxItems": 1})}
    return GrammarSpec(kind="json_schema", value=json.dumps(schema))


def parse_calls(text: str, forced: bool) -> list[ToolCall] | None:
    """The calls in ``text``: a JSON list (a forced call) or ``<tool_call>`` blocks; None when
    there are none or one does not parse (then the text is the answer)."""
    if forced:
        try:
            raw = json.loads(text)
        except ValueError:
            return None
    else:
        blocks = _CALL_RE.findall(text)
        try:
            raw = [json.loads(b) for b in blocks]
        except ValueError:
            return None
    if not raw or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in raw):
        return None
    return [ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                     function=ToolCallFunction(name=c["name"], arguments=json.dumps(c.get("arguments", {}))))
            for c in raw]


def may_become_call(text: str) -> bool:
    """Whether streamed text so far could still be the start of a ``<tool_call>`` block (then it is
    held back rather than streamed as content)."""
    stripped = text.lstrip()
    return CALL_OPEN.startswith(stripped) or stripped.startswith(CALL_OPEN)
