"""The body of an error reply on any subject (the code also travels in a header)."""

from __future__ import annotations

from typing import Literal

from shared.protocol.base import WireModel

# bad_request: the message did not parse or validate; rejected: a domain refusal (draining, prompt
# too long); not_found: unknown model/worker; internal: a bug, logged with its traceback.
ErrorCode = Literal["bad_request", "rejected", "not_found", "internal", "timeout"]


class ErrorReply(WireModel):
    code: ErrorCode
    message: str
    field: str | None = None
