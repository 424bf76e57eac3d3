"""Reasoning content: thinking models (Qwen3, DeepSeek-R1 and its distills, SmolLM3) write their
reasoning between ``<think>`` and ``</think>`` before the answer. The splitter takes the output
text as it is decoded and hands back reasoning and content apart, as vLLM's ``qwen3`` and
``deepseek_r1`` reasoning parsers do.

Two starts: the output opens the reasoning itself (``Start.OUTPUT``, Qwen3: text before the
opening tag, normally only whitespace, is content), or the prompt already opened it
(``Start.PROMPT``: DeepSeek-R1's template ends the generation prompt with ``<think>\\n``, so
everything up to ``</think>`` is reasoning). Whitespace right after ``</think>`` is dropped from
the content; an output cut off before ``</think>`` is all reasoning. Text is held back while it
could still be the start of a tag (as ``shared.openai_api.stop`` holds back stop strings).

gpt-oss writes harmony instead (``Start.HARMONY``, ``shared.openai_api.harmony``): its analysis
channel is the reasoning, the final channel the content.

Pure: no I/O.
"""

from __future__ import annotations

import enum
from typing import Literal

from shared.openai_api.harmony import HarmonySplitter, is_harmony_template

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

ReasoningParser = Literal["auto", "think", "harmony", "none"]


class Start(enum.Enum):
    OUTPUT = "output"  # the output opens with <think>
    PROMPT = "prompt"  # the prompt ends with <think>: the output starts inside the reasoning
    HARMONY = "harmony"  # gpt-oss: messages on channels, analysis the reasoning


class _State(enum.Enum):
    BEFORE = "before"        # content, until an opening tag
    REASONING = "reasoning"  # until the closing tag
    AFTER = "after"          # right after the closing tag: whitespace is dropped
    CONTENT = "content"      # the rest, as it comes


def reasoning_start(parser: ReasoningParser, *, uses_template: bool, template: str | None,
                    prompt_end: str | None) -> Start | None:
    """Whether one request's output is split, and how it starts; None: all of it is content.
    ``uses_template``: the prompt is a chat (``/v1/completions`` is never split); ``template``:
    the model's chat template (``auto`` splits when it mentions ``</think>``, or reads harmony when
    it writes harmony's markers); ``prompt_end``: the end of the rendered prompt (None: not rendered
    here, as for a text worker's model)."""
    if parser == "none" or not uses_template:
        return None
    if parser == "harmony" or (parser == "auto" and is_harmony_template(template)):
        return Start.HARMONY
    if parser == "auto" and (template is None or THINK_CLOSE not in template):
        return None
    if prompt_end is not None and prompt_end.rstrip().endswith(THINK_OPEN):
        return Start.PROMPT
    return Start.OUTPUT


def _held(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """One output's text, split as it comes. ``start`` None: everything is content."""

    def __init__(self, start: Start | None) -> None:
        self._harmony = HarmonySplitter() if start is Start.HARMONY else None
        self._state = {None: _State.CONTENT, Start.OUTPUT: _State.BEFORE, Start.PROMPT: _State.REASONING,
                       Start.HARMONY: _State.CONTENT}[start]
        self._pending = ""

    @property
    def is_reasoning(self) -> bool:
        if self._harmony is not None:
            return self._harmony.is_reasoning
        return self._state is _State.REASONING

    def push(self, text: str) -> tuple[str, str]:
        """Add newly decoded text; return the (reasoning, content) that can be emitted now."""
        if self._harmony is not None:
            return self._harmony.push(text)
        reasoning, content = "", ""
        self._pending += text
        while self._pending:
            if self._state is _State.CONTENT:
                content, self._pending = content + self._pending, ""
            elif self._state is _State.AFTER:
                self._pending = self._pending.lstrip()
                if self._pending:
                    self._state = _State.CONTENT
            else:
                tag = THINK_OPEN if self._state is _State.BEFORE else THINK_CLOSE
                out, found = self._until(tag)
                if self._state is _State.BEFORE:
                    content += out
                else:
                    reasoning += out
                if not found:
                    break
                self._state = _State.REASONING if self._state is _State.BEFORE else _State.AFTER
        return reasoning, content

    def _until(self, tag: str) -> tuple[str, bool]:
        """The pending text up to ``tag`` (consumed with it) and True; or what cannot be the start
        of ``tag`` and False, the rest held."""
        at = self._pending.find(tag)
        if at >= 0:
            out, self._pending = self._pending[:at], self._pending[at + len(tag):]
            return out, True
        keep = _held(self._pending, tag)
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> tuple[str, str]:
        """The held-back text once the output ended: reasoning when cut off inside it."""
        if self._harmony is not None:
            return self._harmony.flush()
        pending, self._pending = self._pending, ""
        return (pending, "") if self._state is _State.REASONING else ("", pending)


def split_reasoning(text: str, start: Start | None) -> tuple[str, str]:
    """A whole output's (reasoning, content)."""
    splitter = ReasoningSplitter(start)
    reasoning, content = splitter.push(text)
    more_reasoning, more_content = splitter.flush()
    return reasoning + more_reasoning, content + more_content
