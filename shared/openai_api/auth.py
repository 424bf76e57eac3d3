"""API keys and tiers: which tier a request runs in, read from its ``Authorization`` header.

The tier travels on ``GenerateRequest.tier`` with its priority on ``GenerateRequest.priority``;
admission holds it to the tier's SLO, the engine and the prefill queue serve by the priority.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from shared.openai_api.errors import ApiError
from shared.policy.qos import QosConfig, parse_api_keys


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

    def tier(self, authorization: str | None) -> str:
        """The tier of the key in ``Authorization: Bearer <key>``; raises a 401 ``ApiError`` when
        keys are configured and this one is missing or unknown."""
        if not self.key_tiers:
            return self.default_tier
        key = _bearer(authorization)
        if not key or key not in self.key_tiers:  # not key: an empty key never matches, even a mistyped ":gold"
            raise ApiError(401, "missing or invalid API key", code="invalid_api_key")
        return self.key_tiers[key]

    def client_id(self, authorization: str | None, peer: str | None) -> str:
        """Whom a per-client limit counts: the API key when keys are on (call ``tier`` first, so
        that it is a known one), else the peer address."""
        if self.key_tiers:
            return "key:" + _bearer(authorization)
        return "peer:" + (peer or "")

    def owner(self, authorization: str | None) -> str | None:
        """Who owns the files, batches and stored responses this request makes, and which ones it
        may see (``owns``): a short hash of its API key (stable across gateways and restarts; the
        key itself is never stored), or None when no keys are configured (one anonymous owner).
        Raises the 401 of ``tier`` for a missing or unknown key."""
        self.tier(authorization)
        return owner_id(_bearer(authorization)) if self.key_tiers else None


def owner_id(key: str) -> str:
    """The owner id of an API key: not the key, and not a way back to it."""
    return "key_" + hashlib.sha256(b"tandem-owner\0" + key.encode()).hexdigest()[:16]


def owns(caller: str | None, owner: str | None) -> bool:
    """Whether a request by ``caller`` (``ApiKeys.owner``) may see an object owned by ``owner``.
    Without keys (caller None) every object is the caller's, as before owners existed. With keys,
    only the key's own: an object stored with no owner (made without keys, or before owners
    were recorded) belongs to the anonymous owner, whom no key is."""
    return caller is None or caller == owner


def _bearer(authorization: str | None) -> str:
    """The key of ``Bearer <key>``; "" (no key) for any other header, a bare key included, so a
    key sent without its scheme is refused rather than guessed at. The scheme is matched without
    regard to case, as RFC 9110 has it."""
    scheme, _, key = (authorization or "").strip().partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""
