"""Tool calls: the tools in the prompt, the grammar that forces a call, and calls read back from
the model's text.

The model writes a call in its family's format (``shared.openai_api.tool_formats``: ``hermes``, the
default, is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; ``mistral`` and
``llama3_json`` too), which chat templates with tool support render as well. A template that does
not know tools gets them in a system message that asks for that form. ``tool_choice: required``
or a named function is enforced by a grammar: the output is then a JSON list of calls (one call
for a named function, or without ``parallel_tool_calls``), whose items are the functions'
``{"name", "arguments"}`` schemas (gpt-oss's are its own call messages instead:
``HarmonyFormat.forced_lark``). Under ``auto``, a ``strict`` function brings a grammar too: text
without the format's call marker, or calls of the declared functions only. In both grammars an argument
schema's objects are closed unless they say otherwise (``closed_schema``).

Every call read back has JSON ``arguments`` and differs from the others: output cut off by the
token limit keeps only the calls written whole (none: the output is text, finish ``length``), and a
repeat of an earlier call's name and arguments is dropped (``ToolUse.calls``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from shared.openai_api.tool_formats import HERMES, MAX_FORCED_CALLS, RawCall, ToolFormat
from shared.protocol.generate import GrammarSpec


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Closed(BaseModel):
    """Every field known: an unknown one is a 400 naming its path (``models._Closed``)."""

    model_config = ConfigDict(extra="forbid")


class FunctionDef(_Closed):
    name: StrictStr = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: StrictStr | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: StrictBool | None = None


class Tool(_Closed):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Closed):
    name: StrictStr


class NamedToolChoice(_Closed):
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


def system_prompt(tools: list[Tool], fmt: ToolFormat = HERMES) -> str:
    specs = "\n".join(json.dumps(t.function.model_dump(exclude_none=True)) for t in tools)
    return "You may call functions. Their signatures:\n" + specs + f"\nTo call one, reply with {fmt.instruction()}."


def _raw_call(call: ToolCall) -> RawCall:
    try:
        return call.function.name, json.loads(call.function.arguments)
    except ValueError:
        return call.function.name, call.function.arguments


def render_calls(calls: list[ToolCall], fmt: ToolFormat = HERMES) -> str:
    """An assistant turn's earlier calls, as the model would have written them."""
    return fmt.render([_raw_call(c) for c in calls]) if calls else ""


def history_message(role: str, content: str, calls: list[ToolCall], fmt: ToolFormat = HERMES,
                    template: str | None = None) -> dict:
    """One message of a conversation for the chat template: an assistant's earlier calls as its
    ``tool_calls`` (arguments as JSON values) where ``template`` renders them itself
    (``ToolFormat.history_calls``: gpt-oss's, which also needs them to render the tool results),
    else written into its content in ``fmt``."""
    if calls and fmt.history_calls(template):
        return {"role": role, "content": content, "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": arguments}}
            for name, arguments in map(_raw_call, calls)]}
    return {"role": role, "content": content + render_calls(calls, fmt)}


def closed_schema(schema):
    """``schema`` with ``additionalProperties: false`` on every object schema that does not say
    otherwise: a tool's arguments have the properties its schema names, nothing else (a small model
    otherwise pads them with keys such as ``type`` or ``description`` until it is cut off)."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            out[key] = {k: closed_schema(v) for k, v in value.items()} if isinstance(value, dict) else value
        elif key in ("items", "prefixItems", "anyOf", "oneOf", "additionalProperties", "not", "contains",
                     "additionalItems", "then", "else", "if"):
            out[key] = closed_schema(value)
        else:  # allOf members stay open: closing each would refuse the properties of the others
            out[key] = value
    is_object = schema.get("type") == "object" or (isinstance(schema.get("type"), list) and "object" in schema["type"]) \
        or "properties" in schema
    if is_object and "additionalProperties" not in schema and "allOf" not in schema \
            and "unevaluatedProperties" not in schema:
        out["additionalProperties"] = False
    return out


# JSON as the forced-call grammar makes the model write it (``shared.grammar``'s default): compact
_COMPACT = {"whitespace_flexible": False}


def call_schema(tool: Tool) -> dict:
    """One call of ``tool`` as the model writes it: ``{"name": <its name>, "arguments": {...}}``,
    the arguments closed (``closed_schema``)."""
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": tool.function.name},
                           "arguments": closed_schema(tool.function.parameters)}}


def _one_of_calls(tools: list[Tool]) -> dict:
    calls = [call_schema(t) for t in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def forced_grammar(tools: list[Tool], choice: ToolChoice | None, parallel: bool,
                   fmt: ToolFormat = HERMES) -> GrammarSpec | None:
    """The grammar of a forced call (``required`` or a named function): calls in ``fmt`` where it
    has such a grammar (``ToolFormat.forced_lark``), else a JSON list of calls; None when the model
    may answer in text."""
    chosen, parallel = _forced_tools(tools, choice, parallel)
    if not chosen:
        return None
    calls = _one_of_calls(chosen)
    if fmt.forced_in_format:
        return GrammarSpec(kind="lark", value=fmt.forced_lark({**calls, "x-guidance": _COMPACT}, parallel))
    schema = {"type": "array", "items": calls, "minItems": 1, "maxItems": MAX_FORCED_CALLS if parallel else 1}
    return GrammarSpec(kind="json_schema", value=json.dumps(schema))


def _forced_tools(tools: list[Tool], choice: ToolChoice | None, parallel: bool) -> tuple[list[Tool], bool]:
    if choice == "required":
        return tools, parallel
    if isinstance(choice, NamedToolChoice):  # one call of that function, as OpenAI makes
        return [t for t in tools if t.function.name == choice.function.name], False
    return [], parallel


def auto_grammar(tools: list[Tool], parallel: bool, fmt: ToolFormat = HERMES) -> GrammarSpec | None:
    """``tool_choice: auto`` with a ``strict`` function: the output is text that holds no call
    marker of ``fmt``, or calls (one without ``parallel_tool_calls``) of the declared functions
    whose arguments match their schemas, and nothing else; None where ``fmt`` has no such grammar."""
    schema = {**_one_of_calls(tools), "x-guidance": _COMPACT}
    lark = fmt.auto_lark(schema, parallel)
    return GrammarSpec(kind="lark", value=lark) if lark is not None else None


def _new_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=ToolCallFunction(name=name, arguments=arguments))


def _new_calls(raw: list[RawCall]) -> list[ToolCall]:
    return [_new_call(name, json.dumps(arguments)) for name, arguments in raw]


def parse_calls(text: str, forced: bool, fmt: ToolFormat = HERMES) -> list[ToolCall] | None:
    """The calls in ``text``: a JSON list (a forced call) or calls in ``fmt``; None when there
    are none or one does not parse (then the text is the answer)."""
    if not forced:
        raw = fmt.parse(text)
        return _new_calls(raw) if raw else None
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in items):
        return None
    return [_new_call(c["name"], json.dumps(c.get("arguments", {}))) for c in items]


def whole_calls(text: str, forced: bool, fmt: ToolFormat = HERMES) -> list[ToolCall]:
    """The calls written whole in output cut off before its end (the token limit), in order; the
    one being written when it was cut off is left out, as its arguments are not JSON yet."""
    if not forced:
        return _new_calls(fmt.whole_calls(text))
    decoder, calls = json.JSONDecoder(), []
    rest = text.lstrip()
    rest = rest[1:] if rest.startswith("[") else ""
    while rest.strip():
        try:
            item, end = decoder.raw_decode(rest.lstrip())
        except ValueError:
            break
        rest = rest.lstrip()[end:].lstrip()
        if rest.startswith(","):
            rest = rest[1:]
        if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
            break
        calls.append(_new_call(item["name"], json.dumps(item.get("arguments", {}))))
    return calls


def distinct_calls(calls: list[ToolCall]) -> list[ToolCall]:
    """``calls`` less those that repeat an earlier one's name and arguments (as JSON values, key
    order aside). A repeat in one reply is, from the small models this serves, a loop rather than
    a wish to run the function twice: dropping it costs a client that wanted two runs one more
    turn, keeping it runs a side effect twice."""
    seen, out = set(), []
    for call in calls:
        key = (call.function.name, json.dumps(json.loads(call.function.arguments), sort_keys=True))
        if key not in seen:
            seen.add(key)
            out.append(call)
    return out


@dataclass(frozen=True)
class ToolUse:
    """What one request lets the model do with its tools (the same for chat completions and
    responses), and how its output reads back as calls."""

    tools: list[Tool]
    choice: ToolChoice | None
    parallel: bool  # parallel_tool_calls is not false
    format: ToolFormat = field(default=HERMES)  # how the model writes calls (--tool-call-parser)
    # the format's markers that are special tokens of the model's tokenizer: kept in the output
    # these calls are read from (a decoder that skips special tokens would drop them), never
    # shown in its content (``visible``)
    special_markers: tuple[str, ...] = ()

    @property
    def mode(self) -> Literal["none", "auto", "forced"]:
        """none: answer in text; auto: the model may call; forced: it must (a grammar sees to it)."""
        if not self.tools or self.choice == "none":
            return "none"
        return "auto" if self.choice in (None, "auto") else "forced"

    def names(self) -> list[str]:
        """The functions the model may call."""
        if self.mode == "forced":
            return [t.function.name for t in _forced_tools(self.tools, self.choice, self.parallel)[0]]
        return [t.function.name for t in self.tools] if self.mode == "auto" else []

    def grammar(self) -> GrammarSpec | None:
        """Forced: a JSON list of calls (or the format's calls: ``forced_grammar``); auto with a
        ``strict`` function: text or valid calls."""
        if self.mode == "forced":
            return forced_grammar(self.tools, self.choice, self.parallel, self.format)
        if self.mode == "auto" and any(t.function.strict for t in self.tools):
            return auto_grammar(self.tools, self.parallel, self.format)
        return None

    def call_start(self, text: str, at_start: bool = True) -> int | None:
        """Where the calls start in an output (``ToolFormat.call_start``; a forced call's at 0);
        None: no call starts in it. The text before it is content, streamed as it comes
        (``adapters.ToolCallStream``)."""
        if self.mode == "none":
            return None
        return 0 if self.mode == "forced" else self.format.call_start(text, at_start)

    def visible(self, text: str) -> str:
        """``text`` as content: without the markers kept for the parser (``special_markers``; all
        of harmony's headers and markers, which its reasoning splitter keeps even without tools)."""
        return self.format.visible(text, self.special_markers)

    def reply(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall] | None]:
        """An output's content and calls (``calls``). With calls, the content is the text before
        the first (stripped; None when blank), as OpenAI and vLLM answer; without, the whole
        text (``visible``)."""
        calls = self.calls(text, finish_reason)
        if not calls:
            return self.visible(text), None
        before = self.visible(text[:self.call_start(text) or 0]).strip()
        return before or None, calls

    def calls(self, text: str, finish_reason: str | None) -> list[ToolCall] | None:
        """The calls ``text`` (the whole output, ended by ``finish_reason``) makes, each once and
        each with JSON arguments; None: it is text. Text before the first call is content
        (``reply``). Output cut off (``length``) keeps the calls written whole; with none, even a
        forced call's output is text (OpenAI returns the cut-off call with its arguments as far as
        written, which no client can parse: docs/api.md)."""
        start = self.call_start(text)
        if start is None:
            return None
        text = text[start:]
        forced = self.mode == "forced" and not self.format.forced_in_format  # a JSON list of calls
        calls = parse_calls(text, forced, self.format) if finish_reason == "stop" else None
        if calls is None and (forced or (finish_reason != "stop" and self.format.starts_call(text))):
            calls = whole_calls(text, forced, self.format)
        if calls and any(c.function.name not in self.names() for c in calls):
            return None  # a function never declared: not a call (auto without a grammar)
        calls = distinct_calls(calls or [])
        return (calls if self.parallel else calls[:1]) or None
