"""The one event-stream reader (loadtest.tools.sse) the load generator, benchmarks and tests share."""

import asyncio

from loadtest.tools import sse

STREAM = (b'data: {"choices": [{"text": "a"}]}\n', b"\n", b"event: response.created\n", b": keep-alive\n",
          b'data:{"usage": {"completion_tokens": 1}}\n', b"data: [DONE]\n")


def test_events_are_the_data_objects_then_done():
    expected = [{"choices": [{"text": "a"}]}, {"usage": {"completion_tokens": 1}}, sse.DONE]
    assert list(sse.events(STREAM)) == expected
    assert list(sse.events(b"".join(STREAM).decode().splitlines())) == expected
    assert sse.parse_line("data: not json") is None and sse.parse_line("") is None


def test_async_events_read_the_same():
    async def lines():
        for line in STREAM:
            yield line

    async def read():
        return [e async for e in sse.aevents(lines())]

    assert asyncio.run(read()) == list(sse.events(STREAM))
