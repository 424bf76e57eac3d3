"""The gateway's ``/status`` page: one typed model, built by the gateway and read by ``tandem
status`` and the dashboard (``/dashboard/data`` carries it as its ``status``)."""

from __future__ import annotations

from pydantic import Field

from shared.protocol.base import WireModel
from shared.protocol.workers import ClusterStatusResult, ServiceInfo


class GatewayState(WireModel):
    in_flight: float = 0
    batch_lines_in_flight: int = 0  # batch lines its runner runs now (not counted in in_flight)
    models: list[str] = Field(default_factory=list)
    num_restarts: int = 0
    urls: list[str] = Field(default_factory=list)  # every gateway of the stack (empty: just this one)
    nats_url: str = ""   # the servers the stack uses, passwords masked ("" from an older gateway)
    redis_url: str = ""


class StatusPage(ClusterStatusResult):
    """The cluster view (the autoscaler's, or the registry alone when it does not answer), where it
    came from, the gateway's own state and every process in the service directory."""

    source: str = ""
    gateway: GatewayState = GatewayState()
    services: list[ServiceInfo] = Field(default_factory=list)
