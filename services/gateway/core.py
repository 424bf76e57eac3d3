"""What the gateway's stateful APIs (Batches, the batch runner, stored Responses) use of the
gateway: its settings and connections, and its one path from a parsed request to an answer. A
Protocol, so those modules do not import ``services.gateway.service``, which imports them."""

from __future__ import annotations

from typing import Protocol

from aiohttp import web

from shared.bus import Bus
from shared.openai_api.adapters import ApiAdapter
from shared.openai_api.auth import ApiKeys
from shared.policy.qos import QosConfig, ServedTier
from shared.protocol import GenerateRequest, Subjects
from shared.tokenizer import Tokenizer
from services.gateway.config import GatewaySettings
from services.gateway.metrics import GatewayMetrics
from services.gateway.server import OnComplete


class GatewayCore(Protocol):
    settings: GatewaySettings
    subjects: Subjects
    bus: Bus
    tokenizer: Tokenizer
    qos: QosConfig
    api_keys: ApiKeys
    metrics: GatewayMetrics
    origin: str  # this gateway process: the origin its requests carry

    def generate_request(self, api: ApiAdapter, tier: str, now: float,
                         prompt_ids: list[int] | None = None) -> GenerateRequest:
        """The request the workers are sent for ``api``: tokenized and hashed, or as text."""

    async def prepared_request(self, api: ApiAdapter, tier: str) -> GenerateRequest:
        """``generate_request`` now, its tokenization off the event loop."""

    async def answer(self, request: web.Request, api: ApiAdapter, served: ServedTier, arrived_at: float,
                     on_complete: OnComplete | None = None) -> web.StreamResponse:
        """Run the parsed request in ``served.tier`` and answer it over HTTP."""

    async def collect(self, api: ApiAdapter, gen_request: GenerateRequest, service_tier: str | None = None) -> dict:
        """The response body of ``gen_request``, run to the end without HTTP, echoing ``service_tier``."""
