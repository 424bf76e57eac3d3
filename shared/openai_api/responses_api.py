"""``/v1/responses`` for text, structured output and function tools: the request (``input`` as a
string or items: messages, ``function_call`` and ``function_call_output``; ``instructions``,
``text.format``, ``tools``, ``tool_choice``), the ``response`` object and its streamed events
(``response.created`` … ``response.output_text.delta`` or ``response.function_call_arguments.delta``
… ``response.completed``). The output is one message, the function calls the model made (as chat
completions make them: ``shared.openai_api.tools``), or both: the message of the text before the
calls, then the calls; after a ``reasoning`` item when a thinking model reasoned first
(``shared.openai_api.reasoning``; streamed as ``response.reasoning_text.delta`` events)."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, StrictBool, StrictStr, Tag, TypeAdapter, model_validator

from shared.openai_api import responses
from shared.openai_api.adapters import (ApiAdapter, Calls, Choice, Delta, ResponseHead, ToolCallStream,
                                        chat_prompt_ids, chat_reasoning_start, conversation, marker_token_ids,
                                        reasoning_token_ids)
from shared.openai_api.errors import ApiError
from shared.openai_api.fields import RESPONSES_FIELDS
from shared.openai_api.models import MAX_TOKEN_COUNT, JsonSchemaFormat, _Body, _Closed, _ToolRequest, refuse_media
from shared.openai_api.reasoning import ReasoningParser, Start
from shared.openai_api.tool_formats import ToolCallParser
from shared.openai_api.tools import (FunctionDef, NamedFunction, NamedToolChoice, Tool, ToolCall,
                                     ToolCallFunction, ToolUse)
from shared.protocol.generate import GenerateRequest, GrammarSpec
from shared.tokenizer import Tokenizer


class InputText(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: StrictStr


class InputMessage(_Body):
    type: Literal["message"] = "message"
    id: StrictStr | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[StrictStr, list[InputText]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class FunctionCallItem(_Body):
    """A call the model made earlier (the SDK sends the output item back as it got it)."""

    type: Literal["function_call"]
    id: StrictStr | None = None
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr

    def call(self) -> ToolCall:
        return ToolCall(id=self.call_id, function=ToolCallFunction(name=self.name, arguments=self.arguments))


class FunctionCallOutputItem(_Body):
    """What a call returned: a ``tool`` message."""

    type: Literal["function_call_output"]
    id: StrictStr | None = None
    call_id: StrictStr
    output: Union[StrictStr, list[InputText]]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(p.text for p in self.output)


def _item_type(item: Any) -> str:
    """A message may leave out its ``type``."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


def _without_reasoning(items: list) -> list:
    """Input items without the ``reasoning`` items of earlier turns (the SDK sends output items
    back as it got them, and a stored conversation holds them): thinking models' chat templates
    leave earlier turns' reasoning out of the prompt, and so does this."""
    return [i for i in items if not (isinstance(i, dict) and i.get("type") == "reasoning")]


InputItem = Annotated[Union[Annotated[InputMessage, Tag("message")],
                            Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")]],
                      Discriminator(_item_type)]
_INPUT_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])


class TextFormat(JsonSchemaFormat):
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None  # required for json_schema only


class TextOptions(_Closed):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ReasoningOptions(_Closed):
    """No effort control: the effort is echoed in the response and changes nothing; a summary is
    refused, since none is made (a thinking model's reasoning comes back whole, as a ``reasoning``
    item)."""

    effort: Effort | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the SDK's older name


class FunctionTool(_Closed):
    """A function as the Responses API declares it (flat, not under ``function``)."""

    type: Literal["function"]
    name: StrictStr = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: StrictStr | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None
    # the SDK's other fields, accepted where they change nothing here
    output_schema: dict | None = None  # describes what the function returns, not what the model writes
    allowed_callers: list[Literal["direct", "programmatic"]] | None = None
    defer_loading: Literal[False] | None = None  # no tool search
    async_: StrictBool | None = Field(None, alias="async")

    def as_tool(self) -> Tool:
        function = FunctionDef(name=self.name, description=self.description, strict=self.strict,
                               **({"parameters": self.parameters} if self.parameters is not None else {}))
        return Tool(type="function", function=function)


class FunctionToolChoice(_Closed):
    type: Literal["function"]
    name: StrictStr


class ConversationParam(_Closed):
    id: StrictStr = Field(min_length=1)


class StreamOptions(_Closed):
    include_obfuscation: StrictBool | None = None  # accepted; events are not padded


class ResponsesRequest(_ToolRequest):
    input: Union[StrictStr, list[InputItem]] = Field(min_length=1)
    instructions: StrictStr | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKEN_COUNT)
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Union[Literal["none", "auto", "required"], FunctionToolChoice] | None = None
    parallel_tool_calls: StrictBool | None = None
    stream_options: StreamOptions | None = None
    store: StrictBool = True
    background: StrictBool = False
    previous_response_id: StrictStr | None = Field(None, min_length=1)
    conversation: Union[Annotated[StrictStr, Field(min_length=1)], ConversationParam] | None = None
    metadata: dict[StrictStr, StrictStr] | None = Field(None, max_length=16)

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: object) -> object:
        if isinstance(data, dict):
            refuse_media(data.get("input"), "input")
            if isinstance(data.get("input"), list):
                data = {**data, "input": _without_reasoning(data["input"])}
        return data

    @property
    def conversation_id(self) -> str | None:
        """The conversation this response belongs to (sent as its id or ``{"id": ...}``)."""
        return self.conversation.id if isinstance(self.conversation, ConversationParam) else self.conversation

    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens

    def num_logprobs(self) -> int | None:
        return None

    def include_usage(self) -> bool:
        return False

    def tool_use(self) -> ToolUse:
        choice = self.tool_choice
        if isinstance(choice, FunctionToolChoice):
            choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        return ToolUse([t.as_tool() for t in self.tools or []], choice, self.parallel_tool_calls is not False,
                       self._tool_format, self._special_markers)

    def check_combinations(self) -> None:
        choice, names = self.tool_choice, [t.name for t in self.tools or []]
        if choice not in (None, "none", "auto") and not names:
            raise ApiError(400, "tool_choice requires tools", param="tool_choice")
        if isinstance(choice, FunctionToolChoice) and choice.name not in names:
            raise ApiError(400, f"tool_choice names {choice.name!r}, not one of the tools {names}",
                           param="tool_choice")
        if self.tool_mode() == "forced" and (self._format_grammar() or self.guided_regex):
            raise ApiError(400, "a forced tool call cannot also have a text.format or guided_regex",
                           param="tool_choice")
        if self.conversation is not None and self.previous_response_id is not None:
            # OpenAI's words and code
            raise ApiError(400, "Mutually exclusive parameters: Ensure you are only providing one of: "
                           "'previous_response_id' or 'conversation'.", code="mutually_exclusive_parameters")
        if self.background and not self.store:
            raise ApiError(400, "background requires store: a background response is only read back stored",
                           param="background", code="invalid_value")
        if self.background and self.stream:
            raise ApiError(400, "background responses are not streamed here: poll GET /v1/responses/{id}",
                           param="stream", code="unsupported_parameter")
        for name in ("summary", "generate_summary"):
            if self.reasoning is not None and getattr(self.reasoning, name) is not None:
                raise ApiError(400, f"reasoning.{name} is not supported: no reasoning summaries are made",
                               param=f"reasoning.{name}", code="unsupported_parameter")

    def continued(self, history: list[dict]) -> "ResponsesRequest":
        """This request after the items of an earlier conversation (``previous_response_id``, or
        a ``conversation``'s items); its own ``input`` comes last."""
        own = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else list(self.input)
        return self.model_copy(update={"input": _INPUT_ITEMS.validate_python(_without_reasoning(history)) + own})

    def messages(self, tokenizer: Tokenizer | None = None) -> list[dict]:
        """The conversation as chat messages: consecutive calls are one assistant turn, each
        call's output a ``tool`` message; ``tokenizer``: the model's, whose chat template may render
        the calls itself (``adapters.conversation``)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        for item in self.input:
            if isinstance(item, FunctionCallItem):
                if messages and messages[-1].get("calls"):
                    messages[-1]["calls"].append(item.call())
                else:
                    messages.append({"role": "assistant", "content": "", "calls": [item.call()]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "content": item.text()})
            else:
                messages.append({"role": item.role, "content": item.text()})
        return conversation([(m["role"], m["content"], m.get("calls", [])) for m in messages], self._tool_format,
                            tokenizer)

    def grammar(self) -> tuple[GrammarSpec, str] | None:
        tools = self.tool_use().grammar()
        if self.tool_mode() == "forced":
            return tools, "tools"
        asked = self._format_grammar() or super().grammar()
        return asked or ((tools, "tools") if tools is not None else None)

    def _format_grammar(self) -> tuple[GrammarSpec, str] | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return GrammarSpec(kind="json_object"), "text.format"
        return GrammarSpec(kind="json_schema", value=json.dumps(fmt.schema_)), "text.format"


class ResponsesAdapter(ApiAdapter[ResponsesRequest]):
    body_type = ResponsesRequest
    fields = RESPONSES_FIELDS
    id_prefix = "resp"
    prompt_param = "input"
    chunk_object = "response"
    named_events = True  # as OpenAI streams them: "event: response.created" before its data line

    def __init__(self, body: ResponsesRequest, tokenizer) -> None:
        super().__init__(body, tokenizer)
        self._seq = 0
        self._text: list[str] = []
        self._item_id = f"msg_{uuid.uuid4().hex}"
        self._finish: str | None = None
        self._tool_use = body.tool_use()
        self._calls: ToolCallStream | None = ToolCallStream(self._tool_use) if self._tool_use.mode != "none" else None
        self._message_open = False
        self._call_items: list[dict] = []  # the calls, once the model has made them
        self._message_item: dict | None = None  # the message of the text before the calls, once they came
        self._reasoning_id = f"rs_{uuid.uuid4().hex}"
        self._thought: list[str] = []  # the reasoning streamed so far
        self._reasoning_open = False
        self._reasoning_item: dict | None = None  # the reasoning item, once it ended
        self.completed: dict | None = None  # the whole response once made (to store it)

    def prompt_ids(self) -> list[int]:
        return chat_prompt_ids(self.tokenizer, self.body.messages(self.tokenizer), self._tool_use, "input")

    def text_prompt(self) -> tuple[str | None, list[dict] | None]:
        return None, self.body.messages(self.tokenizer)

    def kept_token_ids(self) -> frozenset[int]:
        return marker_token_ids(self.tokenizer, self._tool_use) | reasoning_token_ids(self.tokenizer, self.reasoning)

    def decide_reasoning(self, parser: ReasoningParser, request: GenerateRequest) -> Start | None:
        self.reasoning = chat_reasoning_start(parser, self, request)
        return self.reasoning

    def decide_tool_format(self, parser: ToolCallParser) -> None:
        self.body = self.body.with_tool_format(*self._chosen_tool_format(parser))
        self._tool_use = self.body.tool_use()
        self._calls = ToolCallStream(self._tool_use) if self._tool_use.mode != "none" else None

    def _event(self, kind: str, **fields) -> dict:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def _first_index(self) -> int:
        """The output index of the message or the first call: after the reasoning item, if any."""
        return 1 if self._thought else 0

    def _where(self) -> dict:
        return {"item_id": self._item_id, "output_index": self._first_index(), "content_index": 0}

    def opening_chunks(self, head: ResponseHead, index: int) -> list[dict]:
        shell = self._response(head, "in_progress", [], None, None)
        events = [self._event("response.created", response=shell),
                  self._event("response.in_progress", response=shell)]
        # with tools the output may be calls, not a message, and with reasoning a reasoning item
        # comes first: the message opens with the first text
        return events + (self._open_message() if self._calls is None and self.reasoning is None else [])

    def _open_message(self) -> list[dict]:
        self._message_open = True
        return [self._event("response.output_item.added", output_index=self._first_index(),
                            item=self._message("", "in_progress")),
                self._event("response.content_part.added", **self._where(), part=_part(""))]

    def _reasoning_events(self, text: str) -> list[dict]:
        """The reasoning item opened (at its first text), and ``text`` added to it."""
        where = {"item_id": self._reasoning_id, "output_index": 0, "content_index": 0}
        events = []
        if not self._reasoning_open:
            self._reasoning_open = True
            events = [self._event("response.output_item.added", output_index=0,
                                  item={**self._reasoning("", "in_progress"), "content": []}),
                      self._event("response.content_part.added", **where, part=_reasoning_part(""))]
        self._thought.append(text)
        return events + [self._event("response.reasoning_text.delta", **where, delta=text)]

    def _close_reasoning(self, status: str = "completed") -> list[dict]:
        """The reasoning item's end, once the answer starts (or the output ended inside it)."""
        if not self._reasoning_open:
            return []
        self._reasoning_open = False
        text = "".join(self._thought)
        where = {"item_id": self._reasoning_id, "output_index": 0, "content_index": 0}
        self._reasoning_item = self._reasoning(text, status)
        return [self._event("response.reasoning_text.done", **where, text=text),
                self._event("response.content_part.done", **where, part=_reasoning_part(text)),
                self._event("response.output_item.done", output_index=0, item=self._reasoning_item)]

    def _reasoning(self, text: str, status: str) -> dict:
        return {"type": "reasoning", "id": self._reasoning_id, "summary": [],
                "content": [_reasoning_part(text)], "encrypted_content": None, "status": status}

    def chunk(self, head: ResponseHead, index: int, delta: Delta, offset: int) -> dict:
        self._text.append(delta.text)
        return self._event("response.output_text.delta", **self._where(), delta=delta.text, logprobs=[])

    def stream_chunks(self, head: ResponseHead, index: int, delta: Delta, offset: int) -> list[dict]:
        self._finish = delta.finish_reason or self._finish
        reasoning = self._tool_use.visible(delta.reasoning)
        events = self._reasoning_events(reasoning) if reasoning else []
        text = delta.text if self._calls is not None else self._tool_use.visible(delta.text)
        content = Delta(text, delta.logprobs, delta.finish_reason)
        for sent in [content] if self._calls is None else self._calls.push(content):
            if isinstance(sent, Calls):  # after the text before them, if any: its message ends here
                events += self._close_reasoning() + self._close_message(_status(sent.finish_reason))
                events += self._call_events(sent)
            elif sent.text:
                events += self._close_reasoning() + ([] if self._message_open else self._open_message())
                events.append(self.chunk(head, index, sent, offset))
        return events

    def _close_message(self, status: str) -> list[dict]:
        """The end of the message of the text before the calls (none: no text came before)."""
        if not self._message_open:
            return []
        self._message_open = False
        text = "".join(self._text)
        self._message_item = self._message(text, status)
        return [self._event("response.output_text.done", **self._where(), text=text, logprobs=[]),
                self._event("response.content_part.done", **self._where(), part=_part(text)),
                self._event("response.output_item.done", output_index=self._first_index(), item=self._message_item)]

    def _call_events(self, ended: Calls) -> list[dict]:
        """Each call as its item opens, its arguments stream (in one delta: they were held until
        the call was whole) and the item closes, after the message of the text before them."""
        status = _status(ended.finish_reason)
        self._call_items = [_call_item(c, status) for c in ended.calls]
        events = []
        first = self._first_index() + (self._message_item is not None)
        for i, item in enumerate(self._call_items, start=first):
            where = {"item_id": item["id"], "output_index": i}
            events += [self._event("response.output_item.added", output_index=i,
                                   item={**item, "arguments": "", "status": "in_progress"}),
                       self._event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
                       self._event("response.function_call_arguments.done", **where, name=item["name"],
                                   arguments=item["arguments"]),
                       self._event("response.output_item.done", output_index=i, item=item)]
        return events

    def closing_chunks(self, head: ResponseHead, usage: dict) -> list[dict]:
        status = _status(self._finish)
        events = self._close_reasoning(status)  # still open: the output ended inside the reasoning
        before = [self._reasoning_item] if self._reasoning_item is not None else []
        if self._call_items:
            message = [self._message_item] if self._message_item is not None else []
            done = self.completed = self._response(head, status, before + message + self._call_items,
                                                   self._finish, _usage(usage))
            return events + [self._event(f"response.{done['status']}", response=done)]
        text = "".join(self._text)
        if before and not self._message_open:  # ended inside the reasoning: no answer, no message
            done = self.completed = self._response(head, status, before, self._finish, _usage(usage))
            return events + [self._event(f"response.{done['status']}", response=done)]
        events += [] if self._message_open else self._open_message()
        message = self._message(text, status)
        done = self.completed = self._response(head, status, before + [message], self._finish, _usage(usage))
        return events + [self._event("response.output_text.done", **self._where(), text=text, logprobs=[]),
                         self._event("response.content_part.done", **self._where(), part=_part(text)),
                         self._event("response.output_item.done", output_index=self._first_index(), item=message),
                         self._event(f"response.{done['status']}", response=done)]

    def choice(self, index: int, choice: Choice) -> dict:
        content, calls = self._tool_use.reply(choice.text, choice.finish_reason)
        return {"text": content or "", "finish_reason": choice.finish_reason,
                "reasoning": self._tool_use.visible(choice.reasoning), "calls": calls}

    def response(self, head: ResponseHead, choices: list[dict], usage: dict) -> dict:
        first = choices[0]
        finish, status = first["finish_reason"], _status(first["finish_reason"])
        if first["calls"]:  # after the message of the text before them, if any
            output = [self._message(first["text"], status)] if first["text"] else []
            output += [_call_item(c, status) for c in first["calls"]]
        else:
            output = [self._message(first["text"], status)] if first["text"] or not first["reasoning"] else []
        if first["reasoning"]:  # ended by the answer, else cut off inside it (no message then)
            output.insert(0, self._reasoning(first["reasoning"], "completed" if output else status))
        self.completed = self._response(head, status, output, finish, _usage(usage))
        return self.completed

    def shell(self, head: ResponseHead, status: str) -> dict:
        """The response before it has output (``queued``, ``in_progress``) or when it got none
        (``cancelled``, ``failed``)."""
        return self._response(head, status, [], None, None)

    def _message(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self._item_id, "status": status, "role": "assistant",
                "content": [_part(text)] if text or status != "in_progress" else []}

    def _response(self, head: ResponseHead, status: str, output: list[dict], finish: str | None,
                  usage: dict | None) -> dict:
        body = self.body
        choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, FunctionToolChoice) \
            else (body.tool_choice or "auto")
        return {"id": head.request_id.replace("resp-", "resp_", 1), "object": "response",
                "created_at": head.created, "status": status, "model": head.model,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "output": output if status not in ("queued", "in_progress") else [],
                "parallel_tool_calls": body.parallel_tool_calls is not False, "tool_choice": choice,
                "tools": [{"description": None, "strict": None, "parameters": None, **t.model_dump(by_alias=True, exclude_none=True)}
                          for t in body.tools or []],
                "temperature": body.temperature, "top_p": body.top_p,
                "text": {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True)
                                    if body.text and body.text.format else {"type": "text"}),
                         # as asked (OpenAI's default: medium); no verbosity control here
                         "verbosity": (body.text.verbosity if body.text else None) or "medium"},
                # as asked; there is no effort control, so it changed nothing
                "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
                "usage": usage, "previous_response_id": body.previous_response_id,
                "conversation": {"id": body.conversation_id} if body.conversation is not None else None,
                "store": body.store,
                "background": body.background, "metadata": body.metadata or {},
                **responses.tier_field(head.service_tier)}


def _call_item(call: ToolCall, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
            "name": call.function.name, "arguments": call.function.arguments, "status": status}


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def _usage(usage: dict) -> dict:
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}
