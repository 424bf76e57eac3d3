"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

from pydantic import ValidationError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_exceeded", 503: "service_unavailable",
          502: "upstream_error", 504: "timeout", 500: "internal_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None,
                 error_type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s
        self.error_type = error_type  # None: the status's usual type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type or _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def from_validation_error(exc: ValidationError) -> ApiError:
    """A 400 naming the first offending parameter, e.g. ``messages.0.role``."""
    errors = exc.errors()
    # an unknown field says most (in a union, the other members' errors only follow from it)
    first = next((e for e in errors if e.get("type") == "extra_forbidden"), errors[0])
    param = ".".join(str(p) for p in first.get("loc", ())) or None
    if first.get("type") == "extra_forbidden":
        return ApiError(400, f"{param}: unknown field (Unrecognized request argument supplied)", param=param,
                        code="unrecognized_parameter")
    message = first["msg"]
    if first.get("type") == "literal_error" and first.get("ctx"):
        message = f"{message}, got {first.get('input')!r}"
    return ApiError(400, f"{param}: {message}" if param else message, param=param,
                    code="invalid_value" if first.get("type") != "missing" else "missing_parameter")
