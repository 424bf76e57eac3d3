"""The gateway's HTTP edge: a generation as a JSON response or an SSE stream, the middleware that
turns every error into an OpenAI error body and counts responses by status, and the site."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from shared.openai_api import responses
from shared.openai_api.adapters import ApiAdapter, ResponseHead
from shared.openai_api.errors import ApiError
from shared.telemetry.metrics import Counter
from shared.telemetry.phases import server_timing
from services.gateway.generation import Generation

log = logging.getLogger(__name__)


async def respond(request: web.Request, api: ApiAdapter, gen: Generation) -> web.StreamResponse:
    """Answer a started generation: streamed when the body asks for it, else one JSON body."""
    if api.body.stream:
        return await _stream(request, api, gen)
    return await _collect(api, gen)


def _ids(gen: Generation) -> dict[str, str]:
    """Which request, tier and worker (for logs, debugging and the routing tests), the TTFT
    admission predicted for it, and the phases of the TTFT it got (``Server-Timing``)."""
    ids = {"X-Request-Id": gen.request.request_id, "X-Tandem-Worker": gen.worker_id or "",
           "X-Tandem-Tier": gen.request.tier}
    if gen.predicted_ttft_s is not None:
        ids["X-Tandem-Predicted-TTFT-Ms"] = f"{gen.predicted_ttft_s * 1000:.0f}"
    if gen.ttft_s is not None:  # where the time to first token went (sent before the first byte)
        ids["Server-Timing"] = server_timing(gen.phases, gen.ttft_s)
    return ids


def _head(api: ApiAdapter, gen: Generation) -> ResponseHead:
    return ResponseHead(gen.request.request_id, int(gen.request.created_at), api.body.model)


def _usage(gen: Generation) -> dict:
    return responses.usage(gen.num_prompt_tokens, gen.num_completion_tokens, gen.num_cached_tokens)


async def _collect(api: ApiAdapter, gen: Generation) -> web.Response:
    texts, entries, finish = [], [], "length"
    async for delta in gen.deltas():
        texts.append(delta.text)
        entries.extend(delta.logprobs)
        finish = delta.finish_reason or finish
    body = api.response(_head(api, gen), "".join(texts), finish, entries, _usage(gen))
    return web.json_response(body, headers=_ids(gen))


async def _stream(request: web.Request, api: ApiAdapter, gen: Generation) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", **_ids(gen)})
    try:
        await resp.prepare(request)
        await _write_events(resp, api, gen)
    except ConnectionResetError:  # the client went away; the handler's close() cancels at the worker
        log.info("%s: client disconnected", gen.request.request_id)
    return resp


async def _write_events(resp: web.StreamResponse, api: ApiAdapter, gen: Generation) -> None:
    head = _head(api, gen)
    for chunk in api.opening_chunks(head):
        await resp.write(responses.sse_event(chunk))
    offset = 0
    try:
        async for delta in gen.deltas():
            if not delta.text and not delta.finish_reason and not delta.logprobs:
                continue
            await resp.write(responses.sse_event(api.chunk(head, delta, offset)))
            offset += len(delta.text)
    except ApiError as exc:  # mid-stream: the status line is gone, report in the stream
        await resp.write(responses.sse_event(exc.body()))
    if api.body.include_usage():
        await resp.write(responses.sse_event(api.usage_chunk(head, _usage(gen))))
    await resp.write(responses.SSE_DONE)
    await resp.write_eof()


def errors_middleware(requests: Counter):
    """Every error as an OpenAI error body; every ``/v1/`` response counted in ``requests`` by status."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        try:
            resp = await handler(request)
        except ApiError as exc:
            headers = {}
            if exc.retry_after_s is not None and exc.status in (429, 503):
                headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
            resp = web.json_response(exc.body(), status=exc.status, headers=headers)
        except web.HTTPException as exc:  # 404 route, 405 method, 413 body too large
            resp = web.json_response(ApiError(exc.status, exc.reason).body(), status=exc.status)
        except asyncio.CancelledError:
            requests.inc(status="499")  # client closed the connection (nginx's code)
            raise
        except Exception as exc:  # noqa: BLE001 — a bug: log it, answer 500, keep serving
            log.exception("unhandled error on %s", request.path)
            resp = web.json_response(ApiError(500, f"internal error: {type(exc).__name__}").body(), status=500)
        if request.path.startswith("/v1/"):  # probes and scrapes are not requests
            requests.inc(status=str(resp.status))
        return resp

    return middleware


@asynccontextmanager
async def http_site(app: web.Application, host: str, port: int) -> AsyncIterator[int]:
    """Serve ``app`` on ``host:port`` (0: any free port) for the block; yields the bound port."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()
