"""QoS tiers: what each class of client is promised, read from a YAML file (``--qos``).

    default_tier: standard
    tiers:
      premium:  {priority: 0, ttft_slo_ms: 1500, itl_slo_ms: 200}
      standard: {priority: 1, ttft_slo_ms: 5000}
      batch:    {priority: 2, ttft_slo_ms: 30000, max_queued: 200}

A lower ``priority`` number runs first everywhere: admission sheds the highest number first, the
engine schedules and preempts by it, the prefill queue hands it out first. Without a file the stack
has one tier, ``default``, with no SLO: nothing is rejected for latency (the pre-QoS behaviour).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.planner.config import ConfigError, load_yaml, validate_spec

DEFAULT_TIER = "default"


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


class QosConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    default_tier: str
    tiers: dict[str, QosTier] = Field(min_length=1)

    @model_validator(mode="after")
    def _default_is_a_tier(self) -> "QosConfig":
        if self.default_tier not in self.tiers:
            raise ValueError(f"default_tier {self.default_tier!r} is not one of the tiers {sorted(self.tiers)}")
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
