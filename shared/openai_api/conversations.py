"""The request bodies of OpenAI's Conversations API (``/v1/conversations``): a new conversation
with its first items and metadata, a metadata update, items added. Items are the Responses API's
input items (``shared.openai_api.responses_api.InputItem``): text messages, ``function_call`` and
``function_call_output``."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StrictStr, StringConstraints, model_validator

from shared.openai_api.models import _Closed, refuse_media
from shared.openai_api.responses_api import InputItem

MAX_ITEMS_PER_REQUEST = 20  # OpenAI's: "You may add up to 20 items at a time"

# OpenAI's metadata: up to 16 pairs, keys up to 64 characters, values up to 512
Metadata = Annotated[dict[Annotated[StrictStr, StringConstraints(max_length=64)],
                          Annotated[StrictStr, StringConstraints(max_length=512)]], Field(max_length=16)]


class _WithItems(_Closed):
    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: object) -> object:
        if isinstance(data, dict):
            refuse_media(data.get("items"), "items")
        return data


class CreateConversationBody(_WithItems):
    items: list[InputItem] | None = Field(None, max_length=MAX_ITEMS_PER_REQUEST)
    metadata: Metadata | None = None
    safety_identifier: StrictStr | None = None  # accepted: no per-user accounting here


class UpdateConversationBody(_Closed):
    metadata: Metadata | None  # replaces the conversation's metadata (null: none)


class AddItemsBody(_WithItems):
    items: list[InputItem] = Field(min_length=1, max_length=MAX_ITEMS_PER_REQUEST)
