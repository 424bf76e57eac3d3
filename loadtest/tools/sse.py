"""Reading an OpenAI-style event stream (``text/event-stream``): the one parser the load
generator, the benchmarks and the tests share.

A stream is lines of ``data: {json}``, ending with ``data: [DONE]``; other lines (blank
separators, ``event:`` names, ``:`` comments) carry nothing a client here reads.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator

DONE = "[DONE]"   # what the stream's last event parses to


def parse_line(line: bytes | str) -> dict | str | None:
    """One line's event: the JSON object of a ``data: {...}`` line, :data:`DONE` for
    ``data: [DONE]``, None for every other line."""
    text = line.decode() if isinstance(line, bytes) else line
    text = text.strip()
    if not text.startswith("data:"):
        return None
    data = text[len("data:"):].strip()
    if data == DONE:
        return DONE
    return json.loads(data) if data.startswith("{") else None


def events(lines: Iterable[bytes | str]) -> Iterator[dict | str]:
    """The events of a stream read line by line (a ``http.client`` response, ``str.splitlines()``)."""
    for line in lines:
        if (event := parse_line(line)) is not None:
            yield event


async def aevents(lines: AsyncIterable[bytes | str]) -> AsyncIterator[dict | str]:
    """The events of a stream read asynchronously line by line (aiohttp's ``resp.content``)."""
    async for line in lines:
        if (event := parse_line(line)) is not None:
            yield event
