"""The gateway's HTTP edge: a generation as a JSON response or an SSE stream, the middleware that
turns every error into an OpenAI error body and counts responses by status, and the site."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from aiohttp import web

from shared.openai_api import responses
from shared.openai_api.adapters import ApiAdapter, Choice, Delta, ResponseHead
from shared.openai_api.auth import OperatorKey, path_is_operator
from shared.openai_api.errors import ApiError
from shared.telemetry.phases import server_timing
from services.gateway.generation import Generation
from services.gateway.unsupported import unrouted_error

log = logging.getLogger(__name__)


OnComplete = Callable[[], Awaitable[None]]


async def respond(request: web.Request, api: ApiAdapter, gens: list[Generation], request_id: str,
                  on_complete: OnComplete | None = None, service_tier: str | None = None) -> web.StreamResponse:
    """Answer started generations (one per choice, ``gens[i]`` is choice i) of the API request
    ``request_id``: streamed when the body asks for it, else one JSON body; the body and every
    chunk echo ``service_tier`` (None: not asked, not echoed). ``on_complete`` runs once the whole
    response is made and before its end reaches the client (a stored response is stored before
    the client can ask for it)."""
    head = _head(gens, request_id, service_tier)
    if api.body.stream:
        return await _stream(request, api, gens, head, on_complete)
    return await _collect(api, gens, head, on_complete)


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


def _head(gens: list[Generation], request_id: str, service_tier: str | None) -> ResponseHead:
    return ResponseHead(request_id, int(gens[0].request.created_at), gens[0].request.model, service_tier)


def _usage(gens: list[Generation]) -> dict:
    """The prompt counts once, as at OpenAI; completions count for every choice run."""
    return responses.usage(gens[0].num_prompt_tokens, sum(g.num_completion_tokens for g in gens),
                           gens[0].num_cached_tokens)


async def _choice(gen: Generation) -> Choice:
    texts, reasoning, entries, finish = [], [], [], "length"
    async for delta in gen.deltas():
        texts.append(delta.text)
        reasoning.append(delta.reasoning)
        entries.extend(delta.logprobs)
        finish = delta.finish_reason or finish
    return Choice("".join(texts), finish, entries, "".join(reasoning))


def best_choices(choices: list[Choice], n: int) -> list[Choice]:
    """``best_of``: the ``n`` choices with the highest mean token logprob, in that order."""
    if len(choices) == n:
        return choices
    def mean_logprob(c: Choice) -> float:
        return sum(e.logprob for e in c.entries) / len(c.entries) if c.entries else float("-inf")
    return sorted(choices, key=mean_logprob, reverse=True)[:n]


async def _collect(api: ApiAdapter, gens: list[Generation], head: ResponseHead,
                   on_complete: OnComplete | None) -> web.Response:
    body = await _body(api, gens, head)
    if on_complete is not None:
        await on_complete()
    return web.json_response(body, headers=_ids(gens[0]))


async def collect_body(api: ApiAdapter, gens: list[Generation], request_id: str,
                       service_tier: str | None = None) -> dict:
    """The JSON body of started generations, run to the end (also a batch line's response)."""
    return await _body(api, gens, _head(gens, request_id, service_tier))


async def _body(api: ApiAdapter, gens: list[Generation], head: ResponseHead) -> dict:
    choices = best_choices(list(await asyncio.gather(*(_choice(g) for g in gens))), api.body.n)
    return api.response(head, [api.choice(i, c) for i, c in enumerate(choices)], _usage(gens))


async def _stream(request: web.Request, api: ApiAdapter, gens: list[Generation],
                  head: ResponseHead, on_complete: OnComplete | None) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", **_ids(gens[0])})
    try:
        await resp.prepare(request)
        await _write_events(resp, api, gens, head, on_complete)
    except ConnectionResetError:  # the client went away; the handler's close() cancels at the worker
        log.info("%s: client disconnected", head.request_id)
    return resp


async def _merged_deltas(gens: list[Generation]) -> AsyncIterator[tuple[int, Delta]]:
    """Every choice's deltas as they come, tagged with the choice's index; an ``ApiError`` of one
    choice ends the whole stream."""
    if len(gens) == 1:
        async for delta in gens[0].deltas():
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, gen: Generation) -> None:
        try:
            async for delta in gen.deltas():
                await queue.put((index, delta))
        except ApiError as exc:
            await queue.put((index, exc))
        await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        num_open = len(gens)
        while num_open:
            index, item = await queue.get()
            if isinstance(item, ApiError):
                raise item
            if item is None:
                num_open -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _write_events(resp: web.StreamResponse, api: ApiAdapter, gens: list[Generation],
                        head: ResponseHead, on_complete: OnComplete | None) -> None:
    for index in range(len(gens)):
        for chunk in api.opening_chunks(head, index):
            await resp.write(api.sse_event(chunk))
    offsets = [len(api.echo_text())] * len(gens)
    try:
        async for index, delta in _merged_deltas(gens):
            if not delta.text and not delta.reasoning and not delta.finish_reason and not delta.logprobs:
                continue
            for chunk in api.stream_chunks(head, index, delta, offsets[index]):
                await resp.write(api.sse_event(chunk))
            offsets[index] += len(delta.text)
    except ApiError as exc:  # mid-stream: the status line is gone, report in the stream
        await resp.write(api.sse_event(exc.body()))
    closing = api.closing_chunks(head, _usage(gens))
    if on_complete is not None:
        await on_complete()
    for chunk in closing:
        await resp.write(api.sse_event(chunk))
    await resp.write(responses.SSE_DONE)
    await resp.write_eof()


# Basic for the operator pages: a browser opening the dashboard asks for the operator key (as the
# password) on it; API clients send Bearer
_CHALLENGES = {"invalid_api_key": 'Bearer realm="tandem"',
               "invalid_operator_key": 'Basic realm="tandem operator", charset="UTF-8"'}


def operator_middleware(operator_key: OperatorKey):
    """The operator pages (``path_is_operator``: /status, /metrics, /dashboard and below) only for
    requests with the operator key, when one is configured; every other path as before."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        if path_is_operator(request.path):
            operator_key.check(request.headers.get("Authorization"))
        return await handler(request)

    return middleware


def errors_middleware(count: Callable[[int], None]):
    """Every error as an OpenAI error body; every ``/v1/`` response's status passed to ``count``."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        try:
            resp = await handler(request)
        except ApiError as exc:
            headers = {}
            if exc.retry_after_s is not None and exc.status in (429, 503):
                headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
            if exc.status == 401:  # RFC 9110: a 401 names the scheme it wants
                headers["WWW-Authenticate"] = _CHALLENGES.get(exc.code or "", _CHALLENGES["invalid_api_key"])
            resp = web.json_response(exc.body(), status=exc.status, headers=headers)
        except web.HTTPException as exc:  # 404 route, 405 method, 413 body too large
            error = unrouted_error(request) or ApiError(exc.status, exc.reason)
            resp = web.json_response(error.body(), status=error.status)
        except asyncio.CancelledError:
            count(499)  # client closed the connection (nginx's code)
            raise
        except Exception as exc:  # noqa: BLE001 — a bug: log it, answer 500, keep serving
            log.exception("unhandled error on %s", request.path)
            resp = web.json_response(ApiError(500, f"internal error: {type(exc).__name__}").body(), status=500)
        if request.path.startswith("/v1/"):  # probes and scrapes are not requests
            count(resp.status)
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
