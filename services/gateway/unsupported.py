"""OpenAI endpoints this server does not implement: a 404 in the OpenAI error format that says so,
rather than a bare "Not Found" that reads like a wrong base URL."""

from __future__ import annotations

from aiohttp import web

from shared.openai_api.errors import ApiError

UNSUPPORTED = {
    "/v1/embeddings": "embeddings",
    "/v1/images/generations": "image generation",
    "/v1/images/edits": "image editing",
    "/v1/images/variations": "image variations",
    "/v1/audio/speech": "speech synthesis",
    "/v1/audio/transcriptions": "audio transcription",
    "/v1/audio/translations": "audio translation",
    "/v1/moderations": "moderation",
}
SERVED = "/v1/chat/completions, /v1/completions and /v1/responses"


def unsupported_error(path: str) -> ApiError:
    return ApiError(404, f"{UNSUPPORTED[path]} ({path}) is not supported by this server; it serves text "
                    f"generation ({SERVED})", param=None, code="unsupported_endpoint")


def unrouted_error(request: web.Request) -> ApiError | None:
    """A ``/v1/`` path or method that no route serves (``POST /v1/assistants``, ``GET
    /v1/chat/completions``): a 404 that says so, as OpenAI answers a URL it does not know, rather
    than a bare "Not Found" or "Method Not Allowed". None where the router matched (a handler's
    own 404 stays as it is) or the path is not under ``/v1/``."""
    exc = request.match_info.http_exception
    if exc is None or exc.status not in (404, 405) or not request.path.startswith("/v1/"):
        return None
    allowed = getattr(exc, "allowed_methods", None)
    only = f" (this path takes {', '.join(sorted(allowed))})" if allowed else ""
    return ApiError(404, f"{request.method} {request.path} is not supported by this server{only}; it serves text "
                    f"generation ({SERVED}) and the APIs beside them (docs/api.md)", code="unsupported_endpoint")


def add_unsupported_routes(app: web.Application) -> None:
    for path in UNSUPPORTED:
        async def handler(request: web.Request, path: str = path) -> web.Response:
            raise unsupported_error(path)
        app.router.add_route("*", path, handler)
