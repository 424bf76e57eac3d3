"""gpt-oss's "harmony" output, read as vLLM's ``openai`` tool and reasoning parsers read it (with
openai-harmony): a sequence of messages, each a header and a body between special tokens::

    <|channel|>analysis<|message|>…reasoning…<|end|>
    <|start|>assistant<|channel|>final<|message|>…the answer…<|return|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}<|call|>

The output's first message follows the prompt's ``<|start|>assistant``, so its header opens at
``<|channel|>``. A header names the channel, may address a recipient (``to=…``, before or after the
channel) and may give a content type (``<|constrain|>json`` or a bare ``json``). ``<|return|>`` and
``<|call|>`` are end-of-sequence tokens: an engine may stop without putting them in the text.

``HarmonySplitter`` splits the output as it comes: the analysis channel is reasoning; other messages
without a recipient (the final answer, a commentary preamble) are content; a message addressed to a
function (a tool call) goes into the content whole, header and markers included, for the tool
format (``tool_formats.HarmonyFormat``) to read with ``read_messages``. Pure: no I/O.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)  # special tokens of gpt-oss's tokenizer
ENDS = (END, CALL, RETURN)
FUNCTIONS = "functions."  # the recipient prefix of a function call
ROLES = ("assistant", "system", "developer", "user", "tool")

_ANY = re.compile("|".join(map(re.escape, MARKERS)))
_OPEN = re.compile(f"{re.escape(START)}|{re.escape(CHANNEL)}")  # a header starts at either
_BODY_END = re.compile("|".join(map(re.escape, (*ENDS, START))))  # a new <|start|> ends a body left open


def is_harmony_template(template: str | None) -> bool:
    """Whether a chat template writes harmony (``auto`` picks the harmony parsers for it)."""
    return template is not None and (CHANNEL in template or START in template)


@dataclass(frozen=True)
class Header:
    channel: str | None
    recipient: str | None
    content_type: str | None


def parse_header(text: str) -> Header:
    """A message's header (the text before ``<|message|>``) as openai-harmony reads it: the channel
    after ``<|channel|>``, the recipient from ``to=…`` wherever it stands, and the content type the
    last other word (after ``<|constrain|>`` or bare); the role, when written, is left out."""
    text, channel = text.replace(START, " "), None
    at = text.find(CHANNEL)
    if at >= 0:
        name = re.match(r"[^\s<]*", text[at + len(CHANNEL):]).group()
        channel = name or None
        text = text[:at] + " " + text[at + len(CHANNEL) + len(name):]
    parts = text.replace(CONSTRAIN, " ").split()
    recipient = next((p[3:] for p in parts if p.startswith("to=")), None)
    rest = [p for p in parts if not p.startswith("to=") and p not in ROLES]
    return Header(channel, recipient or None, rest[-1] if rest else None)


@dataclass(frozen=True)
class Message:
    start: int  # where its header starts in the text
    stop: int  # where it ends: after its end token, or where its body ends without one
    header: Header
    body: str
    end: str | None  # the token that ended it; None: the text (or a new <|start|>) came first

    @property
    def function(self) -> str | None:
        """The function it calls (``to=functions.NAME``); None: no call."""
        recipient = self.header.recipient
        return recipient[len(FUNCTIONS):] if recipient and recipient.startswith(FUNCTIONS) else None


def read_messages(text: str) -> list[Message]:
    """The messages of ``text`` whose header is whole (read up to ``<|message|>``), in order; text
    outside them is none."""
    messages, at = [], 0
    while (opened := _OPEN.search(text, at)) is not None:
        body_at = text.find(MESSAGE, opened.end())
        if body_at < 0:
            break
        header = parse_header(text[opened.start():body_at])
        body_at += len(MESSAGE)
        ended = _BODY_END.search(text, body_at)
        stop = ended.start() if ended else len(text)
        end = ended.group() if ended and ended.group() != START else None
        at = stop + len(end or "")
        messages.append(Message(opened.start(), at, header, text[body_at:stop], end))
    return messages


def open_header_at(text: str) -> int | None:
    """Where a header starts in ``text`` that its ``<|message|>`` has not yet closed; None: none."""
    messages = read_messages(text)
    opened = _OPEN.search(text, messages[-1].stop if messages else 0)
    return opened.start() if opened is not None else None


def held_tail(text: str) -> int:
    """How many characters at the end of ``text`` could be the start of a marker."""
    for size in range(min(max(map(len, MARKERS)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-size:]) for m in MARKERS):
            return size
    return 0


def visible(text: str) -> str:
    """``text`` without headers and markers: the bodies (a header cut off is left out too)."""
    text = re.sub(f"(?:{_OPEN.pattern})(?:.*?{re.escape(MESSAGE)}|.*$)", "", text, flags=re.S)
    return _ANY.sub("", text)


class Sink(enum.Enum):
    REASONING = "reasoning"  # the analysis channel
    CONTENT = "content"      # the final answer, a preamble
    CALL = "call"            # a message to a recipient: into the content whole


def _sink(header: Header) -> Sink:
    """A call of a function is read by the tool format; a message to another recipient (a built-in
    tool's, which this server does not run) is the model's own work, as its analysis is."""
    if header.recipient is not None and header.recipient.startswith(FUNCTIONS):
        return Sink.CALL
    return Sink.REASONING if header.recipient is not None or header.channel == "analysis" else Sink.CONTENT


class HarmonySplitter:
    """One output's harmony text, split as it comes into (reasoning, content). Messages of one kind
    are joined with a newline (as vLLM joins the analysis messages). Text that could still be the
    start of a marker is held back, and so is a header until its ``<|message|>``."""

    def __init__(self) -> None:
        self._pending = ""
        self._in_header = False
        self._sink: Sink | None = None  # where the body being read goes; None: between messages
        self._has_sent: set[Sink] = set()  # kinds of message already begun

    @property
    def is_reasoning(self) -> bool:
        return self._sink is Sink.REASONING

    def push(self, text: str) -> tuple[str, str]:
        """Add newly decoded text; return the (reasoning, content) that can be emitted now."""
        self._pending += text
        out: dict[Sink, list[str]] = {Sink.REASONING: [], Sink.CONTENT: []}
        while self._step(out):
            pass
        return "".join(out[Sink.REASONING]), "".join(out[Sink.CONTENT])

    def flush(self) -> tuple[str, str]:
        """The held-back text once the output ended: a header cut off is dropped."""
        pending, self._pending = self._pending, ""
        if self._in_header:
            return "", ""
        return (pending, "") if self._sink is Sink.REASONING else ("", pending)

    def _step(self, out: dict[Sink, list[str]]) -> bool:
        """Read what the pending text allows of the current part; False: it needs more text."""
        if self._in_header:
            return self._header(out)
        found = _ANY.search(self._pending)
        cut = found.start() if found else len(self._pending) - held_tail(self._pending)
        text_sink = Sink.CONTENT if self._sink in (None, Sink.CALL) else self._sink
        out[text_sink].append(self._pending[:cut])
        if found is None:
            self._pending = self._pending[cut:]
            return False
        marker = found.group()
        if self._sink is Sink.CALL and marker in ENDS:
            out[Sink.CONTENT].append(marker)
        if marker in ENDS:
            self._sink = None
        if marker in (START, CHANNEL) and (self._sink is None or marker == START):
            self._sink, self._in_header = None, True
            self._pending = self._pending[found.start():]
        else:  # an end, or a marker out of place (dropped)
            self._pending = self._pending[found.end():]
        return True

    def _header(self, out: dict[Sink, list[str]]) -> bool:
        at = self._pending.find(MESSAGE)
        if at < 0:
            return False
        header, self._pending = self._pending[:at], self._pending[at + len(MESSAGE):]
        self._in_header, self._sink = False, _sink(parse_header(header))
        if self._sink is Sink.CALL:
            out[Sink.CONTENT].append(header + MESSAGE)
        elif self._sink in self._has_sent:
            out[self._sink].append("\n")
        self._has_sent.add(self._sink)
        return True
