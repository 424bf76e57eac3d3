"""How one model family writes a tool call in its text, as vLLM's ``--tool-call-parser``: each
format reads calls back from the output, writes earlier calls back into the prompt (multi-turn),
tells a template without tool support how to call, and gives the grammar of "text or calls"
(``tool_choice: auto`` with a ``strict`` function).

- ``hermes`` (Qwen2/2.5/3, SmolLM3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or the newer
  ``[TOOL_CALLS]name[ARGS]{...}`` (repeated for parallel calls).
- ``llama3_json`` (Llama 3.x): the output is a bare ``{"name": ..., "parameters": {...}}``, or several
  separated by ``;``, optionally after ``<|python_tag|>``.
- ``harmony`` (gpt-oss): a message to a function, ``<|channel|>commentary to=functions.NAME
  <|constrain|>json<|message|>{...}<|call|>`` (``shared.openai_api.harmony``), one per call.

A format also says where the calls start in an output (``call_start``; the text before them is
the reply's content) and how much of a streamed output is content that no call can start in
(``content_end``), and names its marker strings (``marker_tokens``): in some families' tokenizers
they are special tokens, which the gateway then keeps in the text read here (vLLM does the same).

A format hands back raw calls, ``(name, arguments)`` with the arguments a JSON value;
``shared.openai_api.tools`` makes them ``ToolCall``s, checks them against the declared functions
and drops repeats. Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import ClassVar, Literal

from shared.grammar.spec import special_token
from shared.openai_api import harmony

ToolCallParser = Literal["auto", "hermes", "mistral", "llama3_json", "harmony"]

RawCall = tuple[str, object]  # (function name, arguments as a JSON value)

_DECODER = json.JSONDecoder()

# The most calls a forced output holds with parallel calls allowed. A small model under a forced
# call, greedy, repeats its first call until the token limit (SmolLM2: 13 identical calls); the
# grammar cannot refuse a repeat (an item unlike the earlier ones is no JSON schema llguidance
# compiles), so it ends the calls here and ``ToolUse.calls`` drops the repeats. Eight is more
# distinct calls than one turn of an agent makes in practice; OpenAI sets no such limit.
MAX_FORCED_CALLS = 8


def _raw(item: object, arguments_key: str = "arguments") -> RawCall | None:
    """``{"name": str, <arguments_key>: ...}`` as a raw call; None when it is not one."""
    if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
        return None
    return item["name"], item.get(arguments_key, item.get("arguments", {}))


def _json_prefix(text: str) -> tuple[object, str] | None:
    """The JSON value ``text`` starts with (after whitespace) and the text after it; None when it
    does not start with a whole one."""
    text = text.lstrip()
    try:
        value, end = _DECODER.raw_decode(text)
    except ValueError:
        return None
    return value, text[end:]


def _separated_calls(text: str, separator: str, arguments_key: str = "arguments") -> list[RawCall]:
    """The whole calls ``text`` starts with, one JSON object each, ``separator`` between them: up to
    the first that is cut off or is not a call."""
    calls = []
    while (found := _json_prefix(text)) is not None and (call := _raw(found[0], arguments_key)) is not None:
        calls.append(call)
        text = found[1].lstrip()
        if not text.startswith(separator):
            break
        text = text[1:]
    return calls


def _is_prefix_either_way(text: str, marker: str) -> bool:
    stripped = text.lstrip()
    return marker.startswith(stripped) or stripped.startswith(marker)


class ToolFormat(ABC):
    """One family's way of writing calls. ``parse`` reads a whole output (None: it is text);
    ``whole_calls`` reads an output cut off by the token limit, keeping the calls written whole."""

    name: ClassVar[str]
    marker: ClassVar[str]  # the text a call starts with
    marker_tokens: ClassVar[tuple[str, ...]]  # every marker the format writes (special tokens in some tokenizers)
    forced_in_format: ClassVar[bool] = False  # a forced call is written in the format (``forced_lark``)

    @abstractmethod
    def parse(self, text: str) -> list[RawCall] | None:
        """The calls in a finished output; None when it makes none or one does not parse."""

    @abstractmethod
    def whole_calls(self, text: str) -> list[RawCall]:
        """The calls written whole at the start of an output cut off before its end, in order."""

    @abstractmethod
    def render(self, calls: list[RawCall]) -> str:
        """Earlier calls of one assistant turn, as the model would have written them."""

    @abstractmethod
    def instruction(self) -> str:
        """How to call, for the system prompt of a template that does not render tools."""

    @abstractmethod
    def calls_rule(self, parallel: bool) -> list[str]:
        """Lark rules ``calls`` (and its terminals) for ``auto_lark``: one call, or several with
        ``parallel``, each call's JSON an ``item`` (defined by ``auto_lark``)."""

    def starts_call(self, text: str) -> bool:
        """Whether the output opens with a call (read as calls even when cut off)."""
        return text.lstrip().startswith(self.marker)

    def may_become_call(self, text: str) -> bool:
        """Whether streamed text so far could still be the start of a call (held back, not
        streamed as content)."""
        return _is_prefix_either_way(text, self.marker)

    def call_start(self, text: str, at_start: bool = True) -> int | None:
        """Where the first call starts in ``text``, the output (at its start: ``starts_call``, or at
        the first marker), or, not ``at_start``, a later part of it (at the first marker); None: no
        call starts in it. The text before the calls is the reply's content."""
        if at_start and self.starts_call(text):
            return 0
        at = text.find(self.marker)
        return at if at >= 0 else None

    def content_end(self, text: str, at_start: bool = True) -> int:
        """How much of ``text`` (an unfinished output in which no call starts, or, not ``at_start``,
        a later part of it) is content whatever comes next: all but an opening that may still become
        a call, a tail that may be the start of the marker, and the whitespace before them (which a
        call would take off the content)."""
        if at_start and self.may_become_call(text):
            return 0
        end = len(text)
        for size in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if text.endswith(self.marker[:size]):
                end -= size
                break
        return len(text[:end].rstrip())

    def visible(self, text: str, special_markers: tuple[str, ...]) -> str:
        """``text`` as content: without the markers kept for the parser (``special_markers``)."""
        for marker in special_markers:
            text = text.replace(marker, "")
        return text

    def history_calls(self, template: str | None) -> bool:
        """Whether earlier calls go to ``template`` as an assistant message's ``tool_calls`` (it
        renders them itself) rather than written into its content (``render``)."""
        return False

    def auto_lark(self, call_schema: dict, parallel: bool) -> str | None:
        """Text that holds no call marker, or calls whose items match ``call_schema``; None: the
        format has no such grammar (the calls are read back unconstrained)."""
        return "\n".join([
            "%llguidance {}",
            "start: TEXT | calls",
            *self.calls_rule(parallel),
            f"item: %json {json.dumps(call_schema)}",
            "TEXT: " + self.text_lexeme(),
        ])

    def forced_lark(self, call_schema: dict, parallel: bool) -> str | None:
        """Calls only (``tool_choice: required`` or a named function), whose items match
        ``call_schema``, in the format; None: the format's forced calls are a JSON list of items
        (``tools.forced_grammar``), read back as one."""
        return None

    def text_lexeme(self) -> str:
        """The lark lexeme of output that is text: here, text without the marker."""
        return "/(.|\\n)*/ & ~/(.|\\n)*" + re.escape(self.marker).replace("/", "\\/") + "(.|\\n)*/"


class HermesFormat(ToolFormat):
    name = "hermes"
    marker = "<tool_call>"
    close = "</tool_call>"
    marker_tokens = (marker, close)
    _block = re.compile(re.escape(marker) + r"\s*(.*?)\s*" + re.escape(close), re.S)

    def parse(self, text: str) -> list[RawCall] | None:
        try:
            raw = [json.loads(b) for b in self._block.findall(text)]
        except ValueError:
            return None
        calls = [_raw(c) for c in raw]
        return calls if calls and all(calls) else None

    def whole_calls(self, text: str) -> list[RawCall]:
        calls, rest = [], text.lstrip()
        while rest.startswith(self.marker):
            found = _json_prefix(rest[len(self.marker):])
            if found is None:
                break
            call, rest = _raw(found[0]), found[1].lstrip()
            if call is None or not rest.startswith(self.close):  # a block counts once closed
                break
            calls.append(call)
            rest = rest[len(self.close):].lstrip()
        return calls

    def render(self, calls: list[RawCall]) -> str:
        return "".join(self.marker + json.dumps({"name": n, "arguments": a}) + self.close for n, a in calls)

    def instruction(self) -> str:
        return f'{self.marker}{{"name": <function name>, "arguments": <arguments object>}}{self.close}'

    def calls_rule(self, parallel: bool) -> list[str]:
        # whitespace inside the tags' lexemes: the lexer must not end one before "<tool_call>" is seen
        return ["calls: call" + ("+" if parallel else ""),
                "call: CALL_OPEN item CALL_CLOSE",
                r"CALL_OPEN: /[ \t\n]*<tool_call>[ \t\n]*/",
                r"CALL_CLOSE: /[ \t\n]*<\/tool_call>[ \t\n]*/"]


class MistralFormat(ToolFormat):
    """``[TOOL_CALLS]`` is a special token, which a decoder that skips special tokens drops (the
    gateway keeps it for a request with tools: ``marker_tokens``); a text worker's decoder may still
    drop it, so a bare list of calls at the start of the output, ``[{"name": ...``, reads as calls too."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    args = "[ARGS]"
    bare = "[{"
    marker_tokens = (marker, args)

    def parse(self, text: str) -> list[RawCall] | None:
        at = text.find(self.marker)
        if at < 0:
            return self._list(text) if text.lstrip().startswith(self.bare) else None
        body = text[at:].replace(self.marker, "").strip()
        calls = self._list(body) if body.startswith("[") else self._named(body, whole_only=False)
        return calls or None

    def whole_calls(self, text: str) -> list[RawCall]:
        if not self.starts_call(text):
            return []
        body = text.lstrip().removeprefix(self.marker).lstrip()
        if body.startswith("["):
            return self._items(body[1:])
        return self._named(body.replace(self.marker, ""), whole_only=True) or []

    def starts_call(self, text: str) -> bool:
        return text.lstrip().startswith((self.marker, self.bare))

    def may_become_call(self, text: str) -> bool:
        stripped = text.lstrip()
        return _is_prefix_either_way(text, self.marker) or self.bare.startswith(stripped) \
            or stripped.startswith(self.bare)

    def _list(self, body: str) -> list[RawCall] | None:
        found = _json_prefix(body)
        if found is None or not isinstance(found[0], list) or found[1].strip():
            return None
        calls = [_raw(c) for c in found[0]]
        return calls if all(calls) else None

    def _items(self, rest: str) -> list[RawCall]:
        """The whole items of a list cut off after its ``[``."""
        return _separated_calls(rest, ",")

    def _named(self, body: str, whole_only: bool) -> list[RawCall] | None:
        """``name[ARGS]{...}`` repeated; None when a finished one does not parse."""
        calls = []
        while body:
            name, sep, rest = body.partition(self.args)
            found = _json_prefix(rest) if sep else None
            if not re.fullmatch(r"[A-Za-z0-9_-]+", name.strip()) or found is None:
                return calls if whole_only else None
            calls.append((name.strip(), found[0]))
            body = found[1].strip()
        return calls

    def render(self, calls: list[RawCall]) -> str:
        return self.marker + json.dumps([{"name": n, "arguments": a} for n, a in calls])

    def instruction(self) -> str:
        return f'{self.marker}[{{"name": <function name>, "arguments": <arguments object>}}]'

    def calls_rule(self, parallel: bool) -> list[str]:
        # the marker as the special token it is in Mistral's tokenizers (which the model writes first, with
        # no space before it), else text, with any whitespace before it in the one lexeme: a lexeme of its own
        # would lose to text's, which takes whitespace as well
        more = '("," item)* ' if parallel else ""
        return [f'calls: {special_token(self.marker, "CALL_OPEN")} WS? "[" item {more}"]"',
                r"CALL_OPEN: /[ \t\n]*\[TOOL_CALLS\]/", r"WS: /[ \t\n]+/"]


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    marker = "<|python_tag|>"
    marker_tokens = (marker,)

    def parse(self, text: str) -> list[RawCall] | None:
        at = text.find(self.marker)
        body = text[at + len(self.marker):] if at >= 0 else text
        if not body.lstrip().startswith("{"):  # prose, even with JSON inside it, is text
            return None
        calls, rest = [], body
        while rest.strip():
            found = _json_prefix(rest)
            call = _raw(found[0], "parameters") if found is not None else None
            if call is None:
                return None
            calls.append(call)
            rest = found[1].lstrip()
            if rest and not rest.startswith(";"):
                return None
            rest = rest[1:]
        return calls or None

    def whole_calls(self, text: str) -> list[RawCall]:
        if not self.starts_call(text):
            return []
        return _separated_calls(self._body(text), ";", "parameters")

    def _body(self, text: str) -> str:
        text = text.lstrip()
        return text[len(self.marker):] if text.startswith(self.marker) else text

    def starts_call(self, text: str) -> bool:
        return self._body(text).lstrip().startswith("{")

    def may_become_call(self, text: str) -> bool:
        return _is_prefix_either_way(text, self.marker) or text.lstrip().startswith("{")

    def render(self, calls: list[RawCall]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)

    def instruction(self) -> str:
        return ('only {"name": <function name>, "parameters": <arguments object>}, several calls '
                'separated by ";"')

    def calls_rule(self, parallel: bool) -> list[str]:
        return ['calls: CALL_OPEN? item' + (' (";" item)*' if parallel else ""),
                r"CALL_OPEN: /[ \t\n]*<\|python_tag\|>[ \t\n]*/"]

    def text_lexeme(self) -> str:
        # a bare JSON object is a call here: text may not start with "{" (nor the tag)
        return "/(.|\\n)*/ & ~/[ \\t\\n]*(\\{|<\\|python_tag\\|>)(.|\\n)*/"


class HarmonyFormat(ToolFormat):
    """gpt-oss: each call a message addressed ``to=functions.NAME`` with JSON arguments; the reply's
    content is the text outside messages and the bodies of those without a recipient (the final
    channel, a preamble). Read from the content the harmony reasoning splitter leaves (the calls in
    it whole, markers included) or from the raw output.

    Its grammars name the markers as the special tokens they are (llguidance's ``<|name|>``: the
    token itself, never text that spells it), the calls in the header form openai-harmony documents
    and gpt-oss writes; each call's arguments are the schema of the function its header names."""

    name = "harmony"
    marker = harmony.START
    marker_tokens = harmony.MARKERS
    forced_in_format = True

    def parse(self, text: str) -> list[RawCall] | None:
        calls = [self._call(m) for m in harmony.read_messages(text) if m.function is not None]
        return calls if calls and all(calls) else None

    def whole_calls(self, text: str) -> list[RawCall]:
        calls = []
        for message in harmony.read_messages(text):
            call = self._call(message) if message.end is not None else None
            if message.function is not None and call is None:
                break
            calls += [call] if call else []
        return calls

    def _call(self, message: harmony.Message) -> RawCall | None:
        found = _json_prefix(message.body)
        if message.function is None or found is None or found[1].strip():
            return None
        return message.function, found[0]

    def call_start(self, text: str, at_start: bool = True) -> int | None:
        return next((m.start for m in harmony.read_messages(text) if m.function is not None), None)

    def starts_call(self, text: str) -> bool:
        at = self.call_start(text)
        return at is not None and not text[:at].strip()

    def content_end(self, text: str, at_start: bool = True) -> int:
        """All but a header not yet closed (a call's, maybe) and a tail that may start a marker."""
        opened = harmony.open_header_at(text)
        end = opened if opened is not None else len(text) - harmony.held_tail(text)
        return len(text[:end].rstrip())

    def visible(self, text: str, special_markers: tuple[str, ...]) -> str:
        return harmony.visible(text)

    def history_calls(self, template: str | None) -> bool:
        return template is not None and "tool_calls" in template

    def render(self, calls: list[RawCall]) -> str:
        return "".join(f"{harmony.START}assistant to=functions.{n}{harmony.CHANNEL}commentary json"
                       f"{harmony.MESSAGE}{json.dumps(a)}{harmony.CALL}" for n, a in calls)

    def instruction(self) -> str:
        return (f"a message {harmony.START}assistant to=functions.<function name>{harmony.CHANNEL}commentary "
                f"json{harmony.MESSAGE}<arguments object>{harmony.CALL}")

    def calls_rule(self, parallel: bool) -> list[str]:
        raise NotImplementedError("harmony's calls name their function in the header: auto_lark builds them")

    def auto_lark(self, call_schema: dict, parallel: bool) -> str | None:
        """Reasoning (analysis messages), then the answer (a final message, or text outside
        messages) or calls of ``call_schema``'s functions."""
        return "\n".join([
            "%llguidance {}",
            "start: analysis* (final | calls) | TEXT",
            f"analysis: <|channel|> \"analysis\" <|message|> TEXT <|end|> {_HARMONY_NEXT}",
            "final: <|channel|> \"final\" <|message|> TEXT <|return|>?",
            "calls: call" + (f" ({_HARMONY_NEXT} call)*" if parallel else ""),
            *self._call_rules(call_schema),
            "TEXT: " + self.text_lexeme(),
        ])

    def forced_lark(self, call_schema: dict, parallel: bool) -> str | None:
        """Calls from the first token, as harmony messages rather than a JSON list: the model writes
        the header it was trained to write, and picks the function there as it would unforced."""
        more = f" ({_HARMONY_NEXT} call){{0,{MAX_FORCED_CALLS - 1}}}" if parallel else ""
        return "\n".join(["%llguidance {}", "start: call" + more, *self._call_rules(call_schema)])

    def _call_rules(self, call_schema: dict) -> list[str]:
        """``call``: one message to one of ``call_schema``'s functions, with its arguments. A later
        call follows the ``<|call|>`` of the one before, which ends gpt-oss's sequence (its
        generation config; llguidance too stops at an end of sequence): in practice one call per
        output, as vLLM's gpt-oss makes."""
        functions = _functions(call_schema)
        rules = ["call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
        for i, (name, arguments) in enumerate(functions):
            header = json.dumps(f"commentary to={harmony.FUNCTIONS}{name} ")
            rules += [f'call_{i}: <|channel|> {header} <|constrain|> "json" <|message|> args_{i} <|call|>',
                      f"args_{i}: %json {json.dumps(arguments)}"]
        return rules

    def text_lexeme(self) -> str:
        # no marker spelled out in text either: the gateway reads the decoded text, where it would
        # read as the marker
        markers = "|".join(re.escape(m).replace("/", "\\/") for m in harmony.MARKERS)
        return f"/(.|\\n)*/ & ~/(.|\\n)*({markers})(.|\\n)*/"


# between two messages of one output: the next one's start and role
_HARMONY_NEXT = '<|start|> "assistant"'


def _functions(call_schema: dict) -> list[tuple[str, dict]]:
    """Each function ``call_schema`` (``tools.call_schema``'s form, one or an ``anyOf`` of them)
    may call, with its arguments' schema (carrying ``call_schema``'s ``x-guidance``)."""
    guidance = {"x-guidance": call_schema["x-guidance"]} if "x-guidance" in call_schema else {}
    return [(c["properties"]["name"]["const"], {**c["properties"]["arguments"], **guidance})
            for c in call_schema.get("anyOf", [call_schema])]


HERMES = HermesFormat()
HARMONY = HarmonyFormat()
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, MistralFormat(), Llama3JsonFormat(), HARMONY)}

_LLAMA3_HEADER = "<|start_header_id|>"


def detect_format(template: str | None) -> ToolFormat:
    """The format a chat template's model writes calls in (``auto``): hermes unless the template
    shows another family's markers."""
    if harmony.is_harmony_template(template):
        return HARMONY
    template = template or ""
    if HermesFormat.marker in template:
        return HERMES
    if MistralFormat.marker in template:
        return FORMATS["mistral"]
    if Llama3JsonFormat.marker in template or (_LLAMA3_HEADER in template and "tools" in template):
        return FORMATS["llama3_json"]
    return HERMES


def tool_format(parser: ToolCallParser, template: str | None) -> ToolFormat:
    """The format ``--tool-call-parser`` names, or, for ``auto``, the one ``template`` shows."""
    return detect_format(template) if parser == "auto" else FORMATS[parser]
