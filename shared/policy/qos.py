"""QoS tiers: what each class of client is promised, read from a YAML file (``--qos``).

    default_tier: standard
    tiers:
      premium:  {priority: 0, ttft_slo_ms: 1500, itl_slo_ms: 200}
      standard: {priority: 1, ttft_slo_ms: 5000}
      batch:    {priority: 2, ttft_slo_ms: 30000, max_queued: 200}
    service_tiers: {flex: batch}    # optional: OpenAI's service_tier → a tier (``ServiceTiers``)

A lower ``priority`` number runs first everywhere: admission sheds the highest number first, the
engine schedules and preempts by it, the prefill queue hands it out first. Without a file the stack
has one tier, ``default``, with no SLO: nothing is rejected for latency (the pre-QoS behaviour).

A request runs in its API key's tier unless it asks for another with OpenAI's ``service_tier``
(``serve_tier``): the key's tier caps it, so a key is never served above its own tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.planner.config import ConfigError, load_yaml, validate_spec

DEFAULT_TIER = "default"

ServiceTierName = Literal["auto", "default", "flex", "priority"]  # OpenAI's ``service_tier`` values


class QosTier(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    priority: int = Field(ge=0)
    ttft_slo_ms: float | None = Field(None, gt=0)
    itl_slo_ms: float | None = Field(None, gt=0)
    max_queued: int | None = Field(None, ge=0, description="requests of this tier waiting at once")

    @property
    def ttft_slo_s(self) -> float | None:
        return None if self.ttft_slo_ms is None else self.ttft_slo_ms / 1000.0

    @property
    def itl_slo_s(self) -> float | None:
        return None if self.itl_slo_ms is None else self.itl_slo_ms / 1000.0


class ServiceTiers(BaseModel):
    """The tier each of OpenAI's ``service_tier`` values asks for; one not given asks for: ``auto``
    and ``default``, the key's own tier (the default tier without keys); ``flex``, the lowest tier
    (highest ``priority`` number); ``priority``, the highest."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    auto: str | None = None
    default: str | None = None
    flex: str | None = None
    priority: str | None = None


@dataclass(frozen=True)
class ServedTier:
    """Where a request runs, and what the client is told of it."""

    tier: str                 # the QoS tier it runs in
    service_tier: str | None  # echoed as the response's ``service_tier``; None: not asked, not echoed
    waits: bool = False       # it asked for ``flex``: admission's 429s for load are waited out


class QosConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    default_tier: str
    tiers: dict[str, QosTier] = Field(min_length=1)
    service_tiers: ServiceTiers = Field(default_factory=ServiceTiers)

    @model_validator(mode="after")
    def _named_tiers_exist(self) -> "QosConfig":
        if self.default_tier not in self.tiers:
            raise ValueError(f"default_tier {self.default_tier!r} is not one of the tiers {sorted(self.tiers)}")
        for name, tier in self.service_tiers.model_dump().items():
            if tier is not None and tier not in self.tiers:
                raise ValueError(f"service_tiers.{name} {tier!r} is not one of the tiers {sorted(self.tiers)}")
        return self

    @classmethod
    def single(cls) -> "QosConfig":
        return cls(default_tier=DEFAULT_TIER, tiers={DEFAULT_TIER: QosTier(priority=0)})

    def resolve(self, name: str | None) -> str:
        """The tier a request named ``name`` runs in: that tier if it is one of these, else the
        default tier (None, "", or a tier another config knows)."""
        return name if name in self.tiers else self.default_tier

    def tier(self, name: str | None) -> QosTier:
        return self.tiers[self.resolve(name)]

    def asked_tier(self, service_tier: ServiceTierName, key_tier: str) -> str:
        """The tier ``service_tier`` asks for (``ServiceTiers``), before the key's cap."""
        named = getattr(self.service_tiers, service_tier)
        if named is not None:
            return named
        if service_tier in ("flex", "priority"):
            by_priority = sorted(self.tiers, key=lambda name: self.tiers[name].priority)
            return by_priority[-1] if service_tier == "flex" else by_priority[0]
        return key_tier

    def service_tier_name(self, tier: str) -> str:
        """OpenAI's name for running in ``tier``: ``default`` for the default tier
        (``service_tiers.default`` when given, else ``default_tier``), ``priority`` above it,
        ``flex`` below it."""
        default = self.service_tiers.default or self.default_tier
        gap = self.tiers[tier].priority - self.tiers[default].priority
        return "default" if tier == default or gap == 0 else ("priority" if gap < 0 else "flex")


def serve_tier(qos: QosConfig, service_tier: ServiceTierName | None, key_tier: str) -> ServedTier:
    """Where a request of a key in ``key_tier`` that asked for ``service_tier`` runs. The key's
    tier caps it: a tier above the key's (a lower ``priority`` number) is served at the key's
    own, as OpenAI serves a tier a project lacks at the one it has, without an error. The echo
    is the value asked for when it was served as asked; for ``auto``, or when capped, the name
    of the tier it runs in (``service_tier_name``). No ``service_tier`` is ``auto``, echoed
    nowhere."""
    asked = qos.asked_tier(service_tier or "auto", key_tier)
    tier = key_tier if qos.tiers[asked].priority < qos.tiers[key_tier].priority else asked
    if service_tier is None:
        return ServedTier(tier, None)
    echoed = service_tier if service_tier != "auto" and tier == asked else qos.service_tier_name(tier)
    return ServedTier(tier, echoed, waits=service_tier == "flex")


def load_qos(path: str | Path | None) -> QosConfig:
    """The file's tiers, or the single default tier when ``path`` is None or empty. A bad file
    raises ConfigError with one line naming the file and the field."""
    if not path:
        return QosConfig.single()
    return validate_spec(QosConfig, load_yaml(path), str(path))


def parse_api_keys(spec: str | None, qos: QosConfig) -> dict[str, str]:
    """``key:tier,key2,...`` → key → tier; a key without a tier gets the default tier. An unknown
    tier raises ConfigError naming it."""
    keys: dict[str, str] = {}
    for pair in (p.strip() for p in (spec or "").split(",")):
        if not pair:
            continue
        key, _, tier = pair.partition(":")
        tier = tier.strip() or qos.default_tier
        if tier not in qos.tiers:
            raise ConfigError(f"api_keys: key {key!r} names tier {tier!r}, not one of {sorted(qos.tiers)}")
        keys[key.strip()] = tier
    return keys
