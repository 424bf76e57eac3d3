"""Secrets out of logs: URLs whose user-info carries a password or token, and a logging filter that
redacts every such URL in every record.

Credentials travel inside the server URLs (``nats://user:pass@host``, ``redis://:pass@host/0``)
because both client libraries read them from there and each service then needs one setting per
server; the price is that a URL is a secret wherever it is printed, hence ``redact_url``.
"""

from __future__ import annotations

import logging
import re
import secrets
from urllib.parse import urlsplit, urlunsplit

REDACTED = "***"
# scheme://[user][:password]@ — the user-info of any URL inside free text
_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<userinfo>[^/@\s]+)@", re.IGNORECASE)


def new_secret() -> str:
    """A fresh random credential, URL-safe (no percent-encoding needed inside a URL)."""
    return secrets.token_urlsafe(24)


def redact_url(url: str) -> str:
    """``url`` with its password (or token, a user-info without a password) replaced by ``***``;
    the user name stays, as it helps to tell which credentials were used. Several URLs separated by
    commas (a NATS cluster) are redacted one by one."""
    if "," in url:
        return ",".join(redact_url(u) for u in url.split(","))
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{_mask(userinfo)}@{hostport}"))


def redact_text(text: str) -> str:
    """Every URL inside ``text`` redacted as ``redact_url`` does."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{_mask(m['userinfo'])}@", text)


def _mask(userinfo: str) -> str:
    user, has_password, _ = userinfo.partition(":")
    return f"{user}:{REDACTED}" if has_password else REDACTED


class RedactSecrets(logging.Filter):
    """Rewrites each record's message with its URLs redacted, whoever logged it (our code or a
    library quoting its server URL in an error)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_text(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:  # the traceback may quote a URL too
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
        return True
