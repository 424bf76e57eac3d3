"""``/v1/responses`` for text and structured output: the request (``input`` as a string or
messages, ``instructions``, ``text.format``), the ``response`` object and its streamed events
(``response.created`` … ``response.output_text.delta`` … ``response.completed``). One output
message per response; tools, conversations and stored responses are refused (see the table)."""

from __future__ import annotations

import json
import uuid
from typing import Literal, Union

from pydantic import Field, StrictStr

from shared.openai_api.adapters import ApiAdapter, Choice, Delta, ResponseHead
from shared.openai_api.errors import ApiError
from shared.openai_api.fields import RESPONSES_FIELDS
from shared.openai_api.models import JsonSchemaFormat, _Body, _Sampling
from shared.protocol.generate import GrammarSpec


class InputText(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: StrictStr


class InputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[StrictStr, list[InputText]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class TextFormat(JsonSchemaFormat):
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None  # required for json_schema only


class TextOptions(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Sampling):
    input: Union[StrictStr, list[InputMessage]] = Field(min_length=1)
    instructions: StrictStr | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    text: TextOptions | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens

    def num_logprobs(self) -> int | None:
        return None

    def messages(self) -> list[dict]:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        return messages + [{"role": m.role, "content": m.text()} for m in self.input]

    def grammar(self) -> tuple[GrammarSpec, str] | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return super().grammar()
        if fmt.type == "json_object":
            return GrammarSpec(kind="json_object"), "text.format"
        return GrammarSpec(kind="json_schema", value=json.dumps(fmt.schema_)), "text.format"


class ResponsesAdapter(ApiAdapter[ResponsesRequest]):
    body_type = ResponsesRequest
    fields = RESPONSES_FIELDS
    id_prefix = "resp"
    prompt_param = "input"
    chunk_object = "response"

    def __init__(self, body: ResponsesRequest, tokenizer) -> None:
        super().__init__(body, tokenizer)
        self._seq = 0
        self._text: list[str] = []
        self._item_id = f"msg_{uuid.uuid4().hex}"
        self._finish: str | None = None

    def prompt_ids(self) -> list[int]:
        try:
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(self.body.messages()))
        except ValueError as exc:
            raise ApiError(400, str(exc), param="input") from None

    def text_prompt(self) -> tuple[str | None, list[dict] | None]:
        return None, self.body.messages()

    def _event(self, kind: str, **fields) -> dict:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def _where(self) -> dict:
        return {"item_id": self._item_id, "output_index": 0, "content_index": 0}

    def opening_chunks(self, head: ResponseHead, index: int) -> list[dict]:
        shell = self._response(head, "in_progress", "", None, None)
        item = self._message("", "in_progress")
        return [self._event("response.created", response=shell),
                self._event("response.in_progress", response=shell),
                self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", **self._where(), part=_part(""))]

    def chunk(self, head: ResponseHead, index: int, delta: Delta, offset: int) -> dict:
        self._text.append(delta.text)
        return self._event("response.output_text.delta", **self._where(), delta=delta.text, logprobs=[])

    def stream_chunks(self, head: ResponseHead, index: int, delta: Delta, offset: int) -> list[dict]:
        self._finish = delta.finish_reason
        return [self.chunk(head, index, delta, offset)] if delta.text else []

    def closing_chunks(self, head: ResponseHead, usage: dict) -> list[dict]:
        text = "".join(self._text)
        done = self._response(head, _status(self._finish), text, self._finish, _usage(usage))
        return [self._event("response.output_text.done", **self._where(), text=text, logprobs=[]),
                self._event("response.content_part.done", **self._where(), part=_part(text)),
                self._event("response.output_item.done", output_index=0, item=done["output"][0]),
                self._event(f"response.{done['status']}", response=done)]

    def choice(self, index: int, choice: Choice) -> dict:
        return {"text": choice.text, "finish_reason": choice.finish_reason}

    def response(self, head: ResponseHead, choices: list[dict], usage: dict) -> dict:
        finish = choices[0]["finish_reason"]
        return self._response(head, _status(finish), choices[0]["text"], finish, _usage(usage))

    def _message(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self._item_id, "status": status, "role": "assistant",
                "content": [_part(text)] if text or status != "in_progress" else []}

    def _response(self, head: ResponseHead, status: str, text: str, finish: str | None,
                  usage: dict | None) -> dict:
        body = self.body
        return {"id": head.request_id.replace("resp-", "resp_", 1), "object": "response",
                "created_at": head.created, "status": status, "model": head.model,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "output": [self._message(text, "completed" if status == "completed" else status)]
                if status != "in_progress" else [],
                "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
                "temperature": body.temperature, "top_p": body.top_p,
                "text": {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True)
                                    if body.text and body.text.format else {"type": "text"})},
                "usage": usage}


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def _usage(usage: dict) -> dict:
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}
