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


def add_unsupported_routes(app: web.Application) -> None:
    for path in UNSUPPORTED:
        async def handler(request: web.Request, path: str = path) -> web.Response:
            raise unsupported_error(path)
        app.router.add_route("*", path, handler)
