"""One adapter per OpenAI endpoint. What differs between ``/v1/chat/completions`` and
``/v1/completions`` lives here: the body type, how the prompt becomes token ids, the request id's
prefix, and the shape of the response and of streamed chunks. The gateway's handlers are written
once against ``ApiAdapter``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Generic, Self, TypeVar

from pydantic import BaseModel, ValidationError

from shared.openai_api import harmony, responses
from shared.openai_api.errors import ApiError, from_validation_error
from shared.openai_api.fields import CHAT_FIELDS, COMPLETION_FIELDS, FieldRule, check_fields
from shared.openai_api.json_body import JsonRefused, load_json
from shared.openai_api.models import ApiRequest, ChatCompletionRequest, CompletionRequest
from shared.openai_api.reasoning import ReasoningParser, Start, reasoning_start
from shared.openai_api.tool_formats import ToolCallParser, ToolFormat, tool_format
from shared.openai_api.tools import ToolCall, ToolUse, history_message, system_prompt
from shared.protocol.generate import GenerateRequest, TokenLogprob
from shared.tokenizer import Tokenizer

Body = TypeVar("Body", ChatCompletionRequest, CompletionRequest)
B = TypeVar("B", bound=BaseModel)


@dataclass
class Delta:
    """Newly completed text of one request; the last one has ``finish_reason``."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    reasoning: str = ""  # newly completed reasoning (``shared.openai_api.reasoning``), before ``text``


@dataclass
class Choice:
    """One finished choice of a non-streamed response."""

    text: str
    finish_reason: str
    entries: list[TokenLogprob]
    reasoning: str = ""


@dataclass(frozen=True)
class ResponseHead:
    """What every response and chunk of one request repeats."""

    request_id: str
    created: int
    model: str
    service_tier: str | None = None  # echoed (shared.policy.qos.serve_tier); None: not asked


@dataclass
class Calls:
    """A choice that ended as tool calls: ``finish_reason`` as generation ended (``stop``, or
    ``length`` for output cut off by the token limit: the calls written whole before it)."""

    calls: list[ToolCall]
    logprobs: list[TokenLogprob]
    finish_reason: str


class ToolCallStream:
    """One streamed choice that may make tool calls. Its content streams as it comes until a call
    starts (``ToolUse.call_start``: at the format's marker, or, for a forced call, at once); from
    there on the output is held, and at the end comes out as calls (or, when it reads as none, as
    content). A tail that may still become the marker, and the whitespace before it, is held until
    the next text tells. What streams as content is what ``ToolUse.reply`` makes the content of the
    whole output, but for whitespace the output starts with; logprobs go with the text they came
    with (a delta the split cuts in two sends its logprobs with the part held back). Each push
    reads only the text held, so a long answer costs linear time."""

    def __init__(self, tool_use: ToolUse) -> None:
        self.tool_use = tool_use
        self.num_sent = 0  # characters of the output streamed as content
        self.held: list[Delta] = []  # the output after those, with its logprobs
        self.start: int | None = None  # where the calls start in the output, once seen

    def push(self, delta: Delta) -> list[Delta | Calls]:
        """What to send now, in order: content deltas (none while held back), and at the end the
        calls (or the rest as content, with the ``finish_reason``)."""
        self.held.append(delta)
        is_opening = self.num_sent == 0  # the format's rules for a call at the output's start apply
        found = False
        if self.start is None:
            at = self.tool_use.call_start(self._held_text(), at_start=is_opening)
            found = at is not None
            self.start = None if at is None else self.num_sent + at
        if delta.finish_reason is not None:
            return self._end(delta.finish_reason)
        if self.start is None:
            return self._content(self.num_sent + self.tool_use.format.content_end(self._held_text(), is_opening))
        return self._content(self._content_end()) if found else []

    def _end(self, finish_reason: str) -> list[Delta | Calls]:
        calls = None
        if self.start is not None:
            calls = self.tool_use.calls(self._held_text()[self.start - self.num_sent:], finish_reason)
        if not calls:
            rest = self._take(self.num_sent + len(self._held_text()))
            return [Delta(self.tool_use.visible(rest.text), rest.logprobs, finish_reason)]
        sent = self._content(self._content_end())
        return sent + [Calls(calls, [e for d in self.held for e in d.logprobs], finish_reason)]

    def _held_text(self) -> str:
        return "".join(d.text for d in self.held)

    def _content_end(self) -> int:
        """Where the content ends once the calls' start is seen: before it and its whitespace."""
        return self.num_sent + len(self._held_text()[:self.start - self.num_sent].rstrip())

    def _content(self, end: int) -> list[Delta]:
        """The output up to ``end`` as a content delta, when there is more of it to send."""
        if end <= self.num_sent:
            return []
        sent = self._take(end)
        sent.text = self.tool_use.visible(sent.text)
        return [sent] if sent.text or sent.logprobs else []

    def _take(self, end: int) -> Delta:
        """The held output up to ``end`` (an offset into the output) with the logprobs of the
        deltas wholly inside it; the rest stays held."""
        text, size = self._held_text(), end - self.num_sent
        taken, kept, at = [], [], 0
        for held in self.held:
            at += len(held.text)
            (taken if at <= size else kept).append(held)
        self.held = [Delta(text[size:], [e for d in kept for e in d.logprobs])] if kept else []
        self.num_sent = end
        return Delta(text[:size], [e for d in taken for e in d.logprobs])


def marker_token_ids(tokenizer: Tokenizer | None, tool_use: ToolUse) -> frozenset[int]:
    """The ids of ``tool_use``'s special markers, for a request whose model may call: a decoder
    keeps them in the output (as vLLM does) for the parser, which would not see a call otherwise
    (Mistral's ``name[ARGS]{...}`` would read ``name{...}``); ``ToolUse.visible`` takes them out of
    the content."""
    if tokenizer is None or tool_use.mode == "none":
        return frozenset()
    ids = (tokenizer.special_token_id(m) for m in tool_use.special_markers)
    return frozenset(i for i in ids if i is not None)


def reasoning_token_ids(tokenizer: Tokenizer | None, start: Start | None) -> frozenset[int]:
    """The ids of harmony's markers for an output its splitter reads (``Start.HARMONY``), with tools
    or without: skipped, the channels could not be told apart; the content never shows them."""
    if tokenizer is None or start is not Start.HARMONY:
        return frozenset()
    ids = (tokenizer.special_token_id(m) for m in harmony.MARKERS)
    return frozenset(i for i in ids if i is not None)


def conversation(messages: list[tuple[str, str, list[ToolCall]]], fmt: ToolFormat,
                 tokenizer: Tokenizer | None) -> list[dict]:
    """``(role, content, earlier calls)`` as the chat template's messages (``history_message``)."""
    template = tokenizer.chat_template if tokenizer is not None else None
    return [history_message(role, content, calls, fmt, template) for role, content, calls in messages]


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict], tool_use: ToolUse, param: str,
                    template_kwargs: dict | None = None) -> list[int]:
    """A conversation's prompt: the tools in the chat template when it renders them, else in a
    system message first (asking for the calls in ``tool_use.format``); ``template_kwargs``:
    extra template variables (``chat_template_kwargs``); a 400 on ``param`` when the template
    refuses the conversation."""
    tools = None
    if tool_use.mode != "none":
        if tokenizer.chat_template_has_tools:
            tools = [t.model_dump(exclude_none=True) for t in tool_use.tools]
        else:
            messages = [{"role": "system", "content": system_prompt(tool_use.tools, tool_use.format)}, *messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools,
                                             extra_variables=template_kwargs)
    except ValueError as exc:
        raise ApiError(400, str(exc), param=param) from None
    return tokenizer.encode(text)


def chat_reasoning_start(parser: ReasoningParser, api: ApiAdapter, request: GenerateRequest) -> Start | None:
    """How the output of a chat-templated request starts (``shared.openai_api.reasoning``): from
    the end of its rendered prompt, or, for a text worker's model (its template is the worker's),
    as if the output opens the reasoning. An output a grammar constrains from its first token (a
    structured output, a forced call) has no room for reasoning: all of it is content."""
    asked = api.body.grammar()
    if asked is not None and not (asked[1] == "tools" and api.body.tool_mode() == "auto"):
        return None
    if request.is_text:
        return reasoning_start(parser, uses_template=True, template=None, prompt_end=None)
    end = api.tokenizer.decode(request.prompt_token_ids[-8:], skip_special_tokens=False)
    return reasoning_start(parser, uses_template=True, template=api.tokenizer.chat_template, prompt_end=end)


def chat_finish_reason(finish_reason: str) -> str:
    """A choice that ended as calls: ``tool_calls``, unless the token limit cut them off."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def parse_body(raw: bytes, body_type: type[B], rules: dict[str, FieldRule] | None = None) -> B:
    """The validated request body; a 400 ``ApiError`` naming the problem otherwise (an unknown or
    refused parameter included: ``rules``)."""
    try:
        data = load_json(raw)
    except JsonRefused as exc:
        raise ApiError(400, f"request body {exc}", param=exc.param, code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    if rules is not None:
        check_fields(data, rules)
    try:
        body = body_type.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    if rules is not None:
        body.check_combinations()
    return body


class ApiAdapter(ABC, Generic[Body]):
    """One request to one endpoint: its validated ``body`` and the tokenizer that reads and
    writes its text."""

    body_type: ClassVar[type[ApiRequest]]
    fields: ClassVar[dict[str, FieldRule]]
    id_prefix: ClassVar[str]      # request ids are "<prefix>-<hex>", as OpenAI's
    prompt_param: ClassVar[str]   # the parameter a too-long prompt is reported on
    chunk_object: ClassVar[str]   # "object" of streamed chunks, the usage chunk included
    named_events: ClassVar[bool] = False  # an "event: <type>" line before each chunk's data line

    def __init__(self, body: Body, tokenizer: Tokenizer) -> None:
        self.body = body
        self.tokenizer = tokenizer
        self.reasoning: Start | None = None  # how the output is split (``decide_reasoning``); None: not

    def decide_reasoning(self, parser: ReasoningParser, request: GenerateRequest) -> Start | None:
        """Whether (and how) ``request``'s output is split into reasoning and content, kept for
        the response's shape. Only chat-templated prompts are (not ``/v1/completions``)."""
        self.reasoning = None
        return None

    def decide_tool_format(self, parser: ToolCallParser) -> None:
        """How the model writes tool calls (``--tool-call-parser``; ``auto``: from the chat
        template), decided before the prompt is rendered and the output read, which then use it.
        ``/v1/completions`` has no tools."""

    def kept_token_ids(self) -> frozenset[int]:
        """Special tokens the output's text keeps although special tokens are skipped: the tool-call
        markers the parser reads (``marker_token_ids``) and harmony's (``reasoning_token_ids``).
        ``/v1/completions`` has neither tools nor reasoning."""
        return frozenset()

    def _chosen_tool_format(self, parser: ToolCallParser) -> tuple[ToolFormat, tuple[str, ...]]:
        """The format, and those of its markers that are special tokens of this tokenizer."""
        fmt = tool_format(parser, self.tokenizer.chat_template if self.tokenizer is not None else None)
        if self.tokenizer is None:
            return fmt, ()
        return fmt, tuple(m for m in fmt.marker_tokens if self.tokenizer.special_token_id(m) is not None)

    def sse_event(self, chunk: dict) -> bytes:
        """One streamed chunk (or an error body) as a server-sent event."""
        return responses.sse_event(chunk, named=self.named_events)

    @classmethod
    def from_json(cls, raw: bytes, tokenizer: Tokenizer) -> Self:
        return cls(parse_body(raw, cls.body_type, cls.fields), tokenizer)

    @abstractmethod
    def prompt_ids(self) -> list[int]:
        """The prompt as token ids; a 400 ``ApiError`` when it cannot be one."""

    @abstractmethod
    def text_prompt(self) -> tuple[str | None, list[dict] | None]:
        """The prompt for a text worker: (prompt text, None) or (None, chat messages)."""

    def opening_chunks(self, head: ResponseHead, index: int) -> list[dict]:
        """Chunks of choice ``index`` streamed before its first token."""
        return []

    def echo_text(self) -> str:
        """Text every choice starts with (the prompt, for ``echo``)."""
        return ""

    @abstractmethod
    def chunk(self, head: ResponseHead, index: int, delta: Delta, offset: int) -> dict:
        """The streamed chunk of choice ``index``'s ``delta``; ``offset``: characters of its text
        streamed before it."""

    @abstractmethod
    def choice(self, index: int, choice: Choice) -> dict:
        """One choice of the whole (non-streamed) response."""

    @abstractmethod
    def response(self, head: ResponseHead, choices: list[dict], usage: dict) -> dict:
        """The whole (non-streamed) response."""

    def stream_chunks(self, head: ResponseHead, index: int, delta: Delta, offset: int) -> list[dict]:
        """What to stream for ``delta``: its chunk, or nothing while output is held back (a tool
        call being written), or several."""
        return [self.chunk(head, index, delta, offset)]

    def closing_chunks(self, head: ResponseHead, usage: dict) -> list[dict]:
        """Chunks streamed after every choice finished."""
        return [self.usage_chunk(head, usage)] if self.body.include_usage() else []

    def usage_chunk(self, head: ResponseHead, usage: dict) -> dict:
        return responses.usage_chunk(head.request_id, head.created, head.model, self.chunk_object, usage,
                                     head.service_tier)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


class ChatAdapter(ApiAdapter[ChatCompletionRequest]):
    body_type = ChatCompletionRequest
    fields = CHAT_FIELDS
    id_prefix = "chatcmpl"
    prompt_param = "messages"
    chunk_object = "chat.completion.chunk"

    def __init__(self, body: ChatCompletionRequest, tokenizer: Tokenizer) -> None:
        super().__init__(body, tokenizer)
        self._streams: dict[int, ToolCallStream] = {}

    def prompt_ids(self) -> list[int]:
        return chat_prompt_ids(self.tokenizer, self._messages(), self.body.tool_use(), "messages",
                               self.body.chat_template_kwargs)

    def text_prompt(self) -> tuple[str | None, list[dict] | None]:
        if self.body.chat_template_kwargs:  # the text worker renders its own template: not silently dropped
            raise ApiError(400, "chat_template_kwargs is not supported for this model: a text worker serves it "
                           "(it renders the chat template itself)", param="chat_template_kwargs",
                           code="unsupported_parameter")
        return None, self._messages()

    def _messages(self) -> list[dict]:
        return conversation([(m.role, m.content_text(), m.tool_calls or []) for m in self.body.messages],
                            self.body.tool_use().format, self.tokenizer)

    def decide_reasoning(self, parser: ReasoningParser, request: GenerateRequest) -> Start | None:
        self.reasoning = chat_reasoning_start(parser, self, request)
        return self.reasoning

    def decide_tool_format(self, parser: ToolCallParser) -> None:
        self.body = self.body.with_tool_format(*self._chosen_tool_format(parser))

    def kept_token_ids(self) -> frozenset[int]:
        return marker_token_ids(self.tokenizer, self.body.tool_use()) | reasoning_token_ids(self.tokenizer,
                                                                                             self.reasoning)

    def stream_chunks(self, head: ResponseHead, index: int, delta: Delta, offset: int) -> list[dict]:
        tool_use = self.body.tool_use()
        if tool_use.mode == "none":  # a message to a function in harmony output is still no content
            visible = Delta(tool_use.visible(delta.text), delta.logprobs, delta.finish_reason, delta.reasoning)
            return [self.chunk(head, index, visible, offset)]
        # the reasoning streams as it comes; only the content may become calls
        reasoning = tool_use.visible(delta.reasoning)
        chunks = [self._reasoning_chunk(head, index, reasoning)] if reasoning else []
        stream = self._streams.setdefault(index, ToolCallStream(tool_use))
        for sent in stream.push(Delta(delta.text, delta.logprobs, delta.finish_reason)):
            if isinstance(sent, Calls):
                chunks += self._call_chunks(head, index, sent)
            elif sent.text or sent.logprobs or sent.finish_reason:  # else reasoning only, sent above
                chunks.append(self.chunk(head, index, sent, offset))
        return chunks

    def _call_chunks(self, head: ResponseHead, index: int, ended: Calls) -> list[dict]:
        """The calls in one delta (their arguments were held until whole), then the finish."""
        calls = [{"index": i, **c.model_dump()} for i, c in enumerate(ended.calls)]
        logprobs = self._logprobs(ended.logprobs) if ended.logprobs else None
        return [responses.chat_chunk(head.request_id, head.created, head.model, index, {"tool_calls": calls},
                                     logprobs=logprobs, service_tier=head.service_tier),
                responses.chat_chunk(head.request_id, head.created, head.model, index, {},
                                     finish_reason=chat_finish_reason(ended.finish_reason),
                                     service_tier=head.service_tier)]

    def opening_chunks(self, head: ResponseHead, index: int) -> list[dict]:
        return [responses.chat_chunk(head.request_id, head.created, head.model, index,
                                     {"role": "assistant", "content": ""}, service_tier=head.service_tier)]

    def chunk(self, head: ResponseHead, index: int, delta: Delta, offset: int) -> dict:
        logprobs = self._logprobs(delta.logprobs) if delta.logprobs else None
        content = {"reasoning_content": delta.reasoning} if delta.reasoning else {}
        if delta.text:
            content["content"] = delta.text
        return responses.chat_chunk(head.request_id, head.created, head.model, index, content,
                                    finish_reason=delta.finish_reason, logprobs=logprobs,
                                    service_tier=head.service_tier)

    def _reasoning_chunk(self, head: ResponseHead, index: int, reasoning: str) -> dict:
        return responses.chat_chunk(head.request_id, head.created, head.model, index,
                                    {"reasoning_content": reasoning}, service_tier=head.service_tier)

    def choice(self, index: int, choice: Choice) -> dict:
        tool_use = self.body.tool_use()
        content, calls = tool_use.reply(choice.text, choice.finish_reason)
        reasoning = tool_use.visible(choice.reasoning)
        thought = {"reasoning_content": reasoning} if reasoning else {}
        if calls:  # the content: the text before the first call (None: none)
            return {"index": index, "message": {"role": "assistant", "content": content, **thought,
                                                "tool_calls": [c.model_dump() for c in calls]},
                    "logprobs": self._logprobs(choice.entries),
                    "finish_reason": chat_finish_reason(choice.finish_reason)}
        body = responses.chat_choice(index, content, choice.finish_reason, self._logprobs(choice.entries))
        if thought:  # an output cut off while reasoning has no content (null, as vLLM)
            body["message"] = {**body["message"], "content": content or None, **thought}
        return body

    def response(self, head: ResponseHead, choices: list[dict], usage: dict) -> dict:
        return responses.envelope(head.request_id, head.created, head.model, "chat.completion", choices, usage,
                                  head.service_tier)

    def _logprobs(self, entries: Sequence[TokenLogprob]) -> dict | None:
        return responses.chat_logprobs(entries, self.token_text) if self.body.logprobs else None


class CompletionAdapter(ApiAdapter[CompletionRequest]):
    body_type = CompletionRequest
    fields = COMPLETION_FIELDS
    id_prefix = "cmpl"
    prompt_param = "prompt"
    chunk_object = "text_completion"

    def prompt_ids(self) -> list[int]:
        prompt = self.body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            vocab = self.tokenizer.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            return list(prompt)
        ids = self.tokenizer.encode(prompt[0] if isinstance(prompt, list) else prompt)
        if not ids:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        return ids

    def text_prompt(self) -> tuple[str | None, list[dict] | None]:
        prompt = self.body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            raise ApiError(400, "a text worker serves this model: the prompt must be text, not token ids",
                           param="prompt")
        return (prompt[0] if isinstance(prompt, list) else prompt), None

    def opening_chunks(self, head: ResponseHead, index: int) -> list[dict]:
        echo = self.echo_text()
        return [responses.completion_chunk(head.request_id, head.created, head.model, index, echo,
                                           service_tier=head.service_tier)] if echo else []

    def echo_text(self) -> str:
        if not self.body.echo:
            return ""
        prompt = self.body.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], int):
            return self.tokenizer.decode(prompt, skip_special_tokens=False)
        return prompt[0] if isinstance(prompt, list) else prompt

    def chunk(self, head: ResponseHead, index: int, delta: Delta, offset: int) -> dict:
        logprobs = self._logprobs(delta.logprobs, offset) if delta.logprobs else None
        return responses.completion_chunk(head.request_id, head.created, head.model, index, delta.text,
                                          finish_reason=delta.finish_reason, logprobs=logprobs,
                                          service_tier=head.service_tier)

    def choice(self, index: int, choice: Choice) -> dict:
        echo = self.echo_text()
        return responses.completion_choice(index, echo + choice.text, choice.finish_reason,
                                           self._logprobs(choice.entries, len(echo)))

    def response(self, head: ResponseHead, choices: list[dict], usage: dict) -> dict:
        return responses.envelope(head.request_id, head.created, head.model, "text_completion", choices, usage,
                                  head.service_tier)

    def _logprobs(self, entries: Sequence[TokenLogprob], offset: int) -> dict | None:
        if self.body.logprobs is None:
            return None
        return responses.completion_logprobs(entries, self.token_text, offset)
