"""Errors that cross the bus. A handler raises ``ServiceError``; the caller gets ``RemoteError``
with the same code (nats.micro style: the code travels in a header, the body is an ErrorReply).

And the bus's own failures to connect (``NatsUnavailable``): one line each, with the exit code a
process that cannot go on without NATS ends with, so that systemd or a script tells them apart."""

from __future__ import annotations

from shared.protocol.errors import ErrorCode


class ServiceError(Exception):
    """A domain failure a handler reports to its caller (not a bug: logged without traceback)."""

    def __init__(self, code: ErrorCode, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


class RemoteError(ServiceError):
    """Raised on the caller's side for an error reply."""


class BusTimeout(ServiceError):
    def __init__(self, subject: str, timeout_s: float) -> None:
        super().__init__("timeout", f"no reply on {subject} within {timeout_s:.3g}s")


class NoResponders(ServiceError):
    def __init__(self, subject: str) -> None:
        super().__init__("not_found", f"nobody serves {subject}")


class MalformedReply(ServiceError):
    """A reply that is not the message the subject carries (bad JSON, a missing field, a value out
    of range such as an unknown ``finish_reason``): the responder broke the protocol."""

    def __init__(self, subject: str, detail: str) -> None:
        super().__init__("bad_request", f"malformed reply on {subject}: {detail}")
        self.detail = detail


class Disconnected(ServiceError):
    """The connection to NATS was lost while a streamed reply was open: what the server sent
    meanwhile may be lost, so the stream ends here (the caller may ask again)."""

    def __init__(self, subject: str) -> None:
        super().__init__("timeout", f"connection to NATS lost while streaming from {subject}")


class NatsUnavailable(ConnectionError):
    """NATS cannot be used; ``exit_code`` is the process's exit code when it gives up for this."""

    exit_code = 1


class NatsUnreachable(NatsUnavailable):
    """No server answered within the deadline (a wrong address or port, a firewall, a host down)."""

    exit_code = 3


class NatsTlsFailed(NatsUnavailable):
    """The TLS handshake failed: the server's certificate is not signed by our CA file, or not for
    the host name dialled, or one side speaks TLS and the other not. Retrying cannot mend it."""

    exit_code = 4


class NatsCredentialsRefused(NatsUnavailable):
    """The server refused the login (a wrong password: the control plane makes a fresh one each
    run). Retrying cannot mend it."""

    exit_code = 5
