"""API keys and tiers: which tier a request runs in, read from its ``Authorization`` header; and
the operator key that opens the gateway's operator pages (``/status``, ``/metrics``, the dashboard).

The tier travels on ``GenerateRequest.tier`` with its priority on ``GenerateRequest.priority``;
admission holds it to the tier's SLO, the engine and the prefill queue serve by the priority.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping
from pathlib import Path

from shared.openai_api.errors import ApiError
from shared.planner.config import ConfigError
from shared.policy.qos import QosConfig, parse_api_keys

# the gateway's pages for whoever runs the stack, not for API clients: the cluster's hosts, PIDs,
# addresses and load (``path_is_operator``)
OPERATOR_PATHS = ("/status", "/metrics", "/dashboard")


class ApiKeys:
    """The key → tier table. An empty table turns authentication off: every request is accepted
    and runs in the default tier."""

    def __init__(self, key_tiers: Mapping[str, str], default_tier: str) -> None:
        self.key_tiers = dict(key_tiers)
        self.default_tier = default_tier

    @classmethod
    def parse(cls, spec: str | None, qos: QosConfig) -> ApiKeys:
        """``"k1:gold,k2"``: k1 runs in tier gold, k2 (no tier given) in the default tier. A tier
        that ``qos`` does not define raises ConfigError."""
        return cls(parse_api_keys(spec, qos), qos.default_tier)

    @classmethod
    def load(cls, spec: str | None, path: str | Path | None, qos: QosConfig) -> ApiKeys:
        """The keys of ``spec`` (``parse``) or of the file at ``path`` (``read_keys_file``), not
        both: two sources would leave unclear which one an operator meant to revoke a key in."""
        if spec and path:
            raise ConfigError("api_keys and api_keys_file are both set: give the keys in one of them")
        return cls(read_keys_file(path, qos), qos.default_tier) if path else cls.parse(spec, qos)

    def tier(self, authorization: str | None) -> str:
        """The tier of the key in ``Authorization: Bearer <key>``; raises a 401 ``ApiError`` when
        keys are configured and this one is missing, malformed (``bearer_key``) or unknown."""
        if not self.key_tiers:
            return self.default_tier
        key = bearer_key(authorization)
        if key not in self.key_tiers:
            raise ApiError(401, "invalid API key", code="invalid_api_key")
        return self.key_tiers[key]

    def client_id(self, authorization: str | None, peer: str | None) -> str:
        """Whom a per-client limit counts: the API key when keys are on (call ``tier`` first, so
        that it is a known one), else the peer address."""
        if self.key_tiers:
            return "key:" + bearer_key(authorization)
        return "peer:" + (peer or "")

    def owner(self, authorization: str | None) -> str | None:
        """Who owns the files, batches and stored responses this request makes, and which ones it
        may see (``owns``): a short hash of its API key (stable across gateways and restarts; the
        key itself is never stored), or None when no keys are configured (one anonymous owner).
        Raises the 401 of ``tier`` for a missing or unknown key."""
        self.tier(authorization)
        return owner_id(bearer_key(authorization)) if self.key_tiers else None


def read_keys_file(path: str | Path, qos: QosConfig) -> dict[str, str]:
    """A keys file: one ``KEY`` or ``KEY:TIER`` per line, as in ``--api-keys``; blank lines and
    ``#`` comments are skipped. A file with no key raises ConfigError: an empty table would turn
    authentication off, which a keys file never means."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"api_keys_file: cannot read {path}: {exc}") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if any(c.isspace() or c == "," for c in line):
            raise ConfigError(f"api_keys_file: {path} line {number} is not KEY or KEY:TIER (one key a line)")
        keys.update(parse_api_keys(line, qos))
    if not keys:
        raise ConfigError(f"api_keys_file: {path} holds no key")
    return keys


class OperatorKey:
    """Who may read the operator pages (``OPERATOR_PATHS``). Without a key configured anyone may,
    as before the key existed; with one, only a request that carries it: ``Bearer <key>`` (scripts,
    Prometheus) or Basic credentials with the key as password and any user name (a browser, which
    asks for them on the 401's ``WWW-Authenticate: Basic``). An API key does not open them."""

    def __init__(self, key: str | None) -> None:
        self.key = key

    @classmethod
    def load(cls, path: str | Path | None) -> OperatorKey:
        """The key in the file at ``path`` (its first line that is not blank or a ``#`` comment);
        no path: no key. A file without a key raises ConfigError."""
        return cls(read_operator_key(path) if path else None)

    @property
    def is_configured(self) -> bool:
        return self.key is not None

    def check(self, authorization: str | None) -> None:
        """Returns when the pages are open to this request; else raises a 401 ``ApiError`` with
        code ``invalid_operator_key``."""
        if self.key is None:
            return
        given = _operator_credential(authorization)
        if given is None or not hmac.compare_digest(given.encode(), self.key.encode()):
            raise ApiError(401, "this page needs the operator key: Authorization: Bearer <operator key>",
                           code="invalid_operator_key")


def operator_headers(path: str | Path | None) -> dict[str, str]:
    """The header that opens the operator pages with the key in the file at ``path`` (for our own
    readers of /status: ``tandem status``, ``tandem up``); none without a path."""
    return {"Authorization": f"Bearer {read_operator_key(path)}"} if path else {}


def read_operator_key(path: str | Path, setting: str = "operator_key_file") -> str:
    """The key in the file at ``path``: its first line that is not empty or a ``#`` comment."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{setting}: cannot read {path}: {exc}") from None
    key = next((s for s in (line.strip() for line in lines) if s and not s.startswith("#")), "")
    if not key or any(c.isspace() for c in key):
        raise ConfigError(f"{setting}: {path} holds no key (one line, no spaces)")
    return key


def path_is_operator(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in OPERATOR_PATHS)


def owner_id(key: str) -> str:
    """The owner id of an API key: not the key, and not a way back to it."""
    return "key_" + hashlib.sha256(b"tandem-owner\0" + key.encode()).hexdigest()[:16]


def owns(caller: str | None, owner: str | None) -> bool:
    """Whether a request by ``caller`` (``ApiKeys.owner``) may see an object owned by ``owner``.
    Without keys (caller None) every object is the caller's, as before owners existed. With keys,
    only the key's own: an object stored with no owner (made without keys, or before owners
    were recorded) belongs to the anonymous owner, whom no key is."""
    return caller is None or caller == owner


def bearer_key(authorization: str | None) -> str:
    """The key of ``Authorization: Bearer <key>`` (RFC 6750: the scheme in any case, then one or
    more spaces, then one token). Anything else raises a 401 ``invalid_api_key`` saying what is
    wrong, never echoing the header: a bare key, another scheme, no key, two words. A key sent
    without its scheme is refused rather than guessed at."""
    scheme, _, rest = (authorization or "").strip().partition(" ")
    if not scheme:
        raise ApiError(401, "missing API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key")
    if scheme.lower() != "bearer":
        raise ApiError(401, "malformed Authorization header: expected 'Bearer <key>' (the scheme Bearer, a space, "
                            "the key)", code="invalid_api_key")
    words = rest.split()
    if len(words) != 1:
        raise ApiError(401, f"malformed Authorization header: 'Bearer' takes one key, got {len(words)} words",
                       code="invalid_api_key")
    return words[0]


def _operator_credential(authorization: str | None) -> str | None:
    """The secret of ``Bearer <secret>`` or the password of ``Basic <base64 user:password>``;
    None for anything else."""
    scheme, _, rest = (authorization or "").strip().partition(" ")
    words = rest.split()
    if len(words) != 1:
        return None
    if scheme.lower() == "bearer":
        return words[0]
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(words[0], validate=True).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return None
    return None
