"""Settings shared by every service.

Each service has one settings class (pydantic-settings, ``TANDEM_`` env prefix). Every field is
also a ``--flag`` (``services.framework.command``); precedence: flag, then environment, then default.
The compose test checks its files against exactly these flags and variables.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="forbid")

    nats_url: str = Field("nats://127.0.0.1:4222", description="NATS server URL, or several separated by "
                          "commas (a cluster's members: the client fails over between them)")
    nats_ca: str | None = Field(None, description="CA certificate file (PEM): connect to NATS over TLS and "
                                "accept only a server certificate it signed (tandem up --nats-tls writes one)")
    nats_replicas: int | None = Field(None, ge=1, le=5, description="copies JetStream keeps of each stream "
                                      "and bucket a service creates (default: 1 on one server, up to 3 on a "
                                      "cluster, from the members the server names)")
    namespace: str = Field("tandem", pattern=r"^[A-Za-z0-9_-]{1,64}$",
                           description="first token of every subject, bucket and Redis key")
    registry_ttl_s: float = Field(6.0, gt=0, description="worker registry entry TTL (heartbeat: TTL/3)")
    log_level: str = Field("INFO", description="logging level")
    log_format: Literal["text", "json"] = Field("text", description="log lines as text, or as JSON lines "
                                                "carrying request_id and trace_id")
    num_restarts: int = Field(0, ge=0, description="times a supervisor (tandem up) restarted this process "
                              "after a crash; workers report it in the registry")
    metrics_host: str = Field("127.0.0.1", description="Prometheus /metrics listen address (0.0.0.0: every "
                              "interface, as in a container)")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port (0: any free port); "
                              "the address is published in the service directory and `tandem status`")
    metrics_key_file: str | None = Field(None, description="file holding the key /metrics then requires as "
                                         "`Authorization: Bearer KEY` (default: /metrics answers whoever reaches "
                                         "metrics_host)")

    @field_validator("metrics_key_file")
    @classmethod
    def _metrics_key_loads(cls, path: str | None) -> str | None:
        """A file that holds no key is a one-line error at startup, not a /metrics nobody can read."""
        from shared.openai_api.auth import read_operator_key  # noqa: PLC0415

        if path:
            read_operator_key(path, "metrics_key_file")
        return path


class QosSettings(BaseSettings):
    """The QoS fields of gateway, admission and ``tandem up``: a tiers file, checked at startup so
    that a bad file is a one-line error naming the field (``shared.policy.qos``)."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="forbid")

    qos: str | None = Field(None, description="QoS tiers YAML file (see examples/qos.yaml); unset: one "
                            "tier, no SLO")

    @field_validator("qos")
    @classmethod
    def _qos_file_loads(cls, path: str | None) -> str | None:
        from shared.policy.qos import load_qos  # noqa: PLC0415 — pulls in the planner's YAML helpers

        load_qos(path)
        return path


def settings_env_names(cls: type[BaseSettings]) -> set[str]:
    return {f"TANDEM_{name.upper()}" for name in cls.model_fields}
