"""What every client check shares: the gateway it talks to, a client library and its checks, the
prompts and schemas they send, and the assertion that a check raises."""

from __future__ import annotations

import importlib.metadata
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel

FEATURES = {"chat": "Chat", "stream": "Streaming", "tools_forced": "Tools (forced)", "tools_auto": "Tools (auto)",
            "structured": "Structured output", "responses": "Responses", "stored": "Stored responses",
            "conversations": "Conversations", "files_batches": "Files / batches"}
TIMEOUT_S = 120.0
WEATHER_PROMPT = "What is the weather in Paris?"
# prompts SmolLM2 answers greedily in under 60 tokens, for clients that fail on a response cut short
SHORT_WEATHER_PROMPT = "Weather in Paris?"
FIRST_TURN, SECOND_TURN = "Hi! I'm Ada.", "Say hello."


class City(BaseModel):
    """The structured output every client asks for."""

    city: str
    country: str


CITY_PROMPT = "Name a city and its country."
CHAT_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"]}}}
RESPONSES_WEATHER = {"type": "function", **CHAT_WEATHER["function"], "strict": False}


@dataclass(frozen=True)
class Target:
    """The gateway every check talks to: its base URL (no ``/v1``) and the model it serves."""

    base_url: str
    model: str

    @property
    def v1(self) -> str:
        return self.base_url.rstrip("/") + "/v1"


Check = Callable[[Target], None]


@dataclass(frozen=True)
class Client:
    """A client library: ``version()`` is its installed version or None (not installed); ``checks``
    maps a feature of ``FEATURES`` to the function that exercises it (absent: no such API)."""

    name: str
    version: Callable[[], str | None]
    checks: dict[str, Check] = field(default_factory=dict)


def distribution(name: str) -> Callable[[], str | None]:
    def version() -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None
    return version


def expect(condition: object, what: str) -> None:
    """A check's assertion: raised as an error the result records (``assert`` vanishes under -O)."""
    if not condition:
        raise AssertionError(what)


def json_object(arguments: str) -> dict:
    parsed = json.loads(arguments)
    expect(isinstance(parsed, dict), f"arguments are not a JSON object: {arguments!r}")
    return parsed


def poll(get, is_done, timeout_s: float = TIMEOUT_S):
    """``get()`` until ``is_done`` of it; its last value. Raises after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not is_done(value := get()):
        expect(time.monotonic() < deadline, f"not done after {timeout_s:g}s: {value}")
        time.sleep(0.2)
    return value


def openai_client(t: Target):
    """The official Python SDK's client, as the docs show it for another base URL."""
    import openai

    return openai.OpenAI(base_url=t.v1, api_key="unused", max_retries=0, timeout=TIMEOUT_S)
