"""API keys and tiers: which tier a request runs in, read from its ``Authorization`` header.

The tier travels on ``GenerateRequest.tier``; admission and the workers decide what it means.
"""

from __future__ import annotations

from collections.abc import Mapping

from shared.openai_api.errors import ApiError

DEFAULT_TIER = "default"


class ApiKeys:
    """The key → tier table. An empty table turns authentication off: every request is accepted
    and runs in ``DEFAULT_TIER``."""

    def __init__(self, key_tiers: Mapping[str, str]) -> None:
        self.key_tiers = dict(key_tiers)

    @classmethod
    def parse(cls, spec: str | None) -> ApiKeys:
        """``"k1:gold,k2"``: k1 runs in tier gold, k2 (no tier given) in the default tier."""
        pairs = [p.strip() for p in (spec or "").split(",") if p.strip()]
        return cls({key: tier or DEFAULT_TIER for key, _, tier in (p.partition(":") for p in pairs)})

    def tier(self, authorization: str | None) -> str:
        """The tier of the key in ``Authorization: Bearer <key>``; raises a 401 ``ApiError`` when
        keys are configured and this one is missing or unknown."""
        if not self.key_tiers:
            return DEFAULT_TIER
        key = (authorization or "").removeprefix("Bearer ").strip()
        if key not in self.key_tiers:
            raise ApiError(401, "missing or invalid API key", code="invalid_api_key")
        return self.key_tiers[key]
