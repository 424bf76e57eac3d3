"""gateway: the OpenAI-compatible HTTP API in front of admission and the decode workers.

The handlers are written once for both endpoints against an ``ApiAdapter`` (shared/openai_api):
API key → tier, body → prompt ids → ``GenerateRequest`` (with the context rules), then a
``Generation`` (admission, the worker's stream, detokenization, stop strings) answered as JSON or
SSE (``server.py``). A client that disconnects cancels its request at the worker (aiohttp cancels
the handler; ``Generation.close`` publishes the cancel).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from aiohttp import web

from shared.bus import Bus, ServiceError, WorkerRegistry
from shared.cluster.workers import ready_workers
from shared.openai_api.adapters import ApiAdapter, ChatAdapter, CompletionAdapter
from shared.openai_api.auth import ApiKeys
from shared.openai_api.errors import ApiError
from shared.policy.qos import load_qos
from shared.policy.rate_limit import RateLimiter
from shared.openai_api.generate_request import build_generate_request, prompt_block_hashes
from shared.protocol import ClusterStatusRequest, Subjects, WorkerInfo
from shared.bus.kv import KvBucket
from shared.runtime.announce import list_services, open_services
from shared.runtime.service import bus_connection, every, serve_until_stopped
from shared.tokenizer import Tokenizer, load_tokenizer
from services.gateway.config import GatewaySettings
from services.gateway.generation import Generation
from services.gateway.server import errors_middleware, http_site, respond
from services.gateway.metrics import GatewayMetrics

__all__ = ["Gateway", "build_app", "load_tokenizer", "run"]  # load_tokenizer: tests import it here

log = logging.getLogger(__name__)


class Gateway:
    def __init__(self, settings: GatewaySettings, bus: Bus, registry: WorkerRegistry,
                 tokenizer: Tokenizer) -> None:
        self.settings = settings
        self.subjects = Subjects(settings.namespace)
        self.bus = bus
        self.registry = registry
        self.tokenizer = tokenizer
        self.workers: list[WorkerInfo] = []
        self.qos = load_qos(settings.qos)
        self.api_keys = ApiKeys.parse(settings.api_keys, self.qos)
        self.rate_limiter = (RateLimiter(settings.rate_limit_per_s, settings.rate_limit_burst)
                             if settings.rate_limit_per_s else None)
        self.metrics = GatewayMetrics.create()
        self._services: KvBucket | None = None  # bound at the first /status

    # --- lifecycle and cluster view --------------------------------------------------------------
    async def start(self) -> None:
        """Nothing to subscribe to: the HTTP site is the gateway's endpoint."""

    async def run_forever(self) -> None:
        await every(self.settings.refresh_interval_s, self.refresh, "registry refresh")

    async def refresh(self) -> None:
        self.workers = await self.registry.list()

    def ready_workers(self, model: str | None = None) -> list[WorkerInfo]:
        return ready_workers(self.workers, "decode", model)

    def served_models(self) -> list[str]:
        return sorted({self.settings.model} | {w.model for w in self.ready_workers()})

    def _started_at(self, worker_id: str) -> float | None:
        return next((w.started_at for w in self.workers if w.worker_id == worker_id), None)

    # --- generation ------------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, ChatAdapter)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, CompletionAdapter)

    async def _generate(self, request: web.Request, adapter: type[ApiAdapter]) -> web.StreamResponse:
        tier = self.api_keys.tier(request.headers.get("Authorization"))
        self._check_rate(request)
        api = adapter.from_json(await request.read(), self.tokenizer)
        model = api.body.model
        gen_request = build_generate_request(
            api, api.prompt_ids(), tier=tier, priority=self.qos.tiers[tier].priority,
            workers=self.ready_workers(model),
            served_models=self.served_models(), default_max_tokens=self.settings.default_max_tokens,
            now=time.time())
        gen = Generation(self.bus, self.subjects, self.settings, self.tokenizer, self.metrics,
                         gen_request, api.body.stop_strings(), worker_started_at=self._started_at,
                         has_ready_worker=lambda: bool(self.ready_workers(model)),
                         rehash=lambda ids: prompt_block_hashes(ids, self.ready_workers(model)))
        self.metrics.in_flight.inc()
        try:
            await gen.start()
            return await respond(request, api, gen)
        finally:
            self.metrics.in_flight.dec()
            self.metrics.generated.inc(gen.num_completion_tokens)
            await gen.close()

    def _check_rate(self, request: web.Request) -> None:
        """A 429 when this client (its API key, else its address) is over its rate."""
        if self.rate_limiter is None:
            return
        client = self.api_keys.client_id(request.headers.get("Authorization"), request.remote)
        wait_s = self.rate_limiter.acquire(client, time.monotonic())
        if wait_s is not None:
            raise ApiError(429, f"rate limit exceeded ({self.settings.rate_limit_per_s:g} requests/s, burst "
                           f"{self.settings.rate_limit_burst}); retry in {wait_s:.1f}s",
                           code="rate_limit_exceeded", retry_after_s=math.ceil(wait_s))

    # --- models, probes, metrics, status ---------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "tandem"} for m in self.served_models()]})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        workers = self.ready_workers()
        num_prefill = len(ready_workers(self.workers, "prefill"))
        return web.json_response({"ready": bool(workers), "num_ready_decode_workers": len(workers),
                                  "num_ready_prefill_workers": num_prefill}, status=200 if workers else 503)

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.registry.render(), content_type="text/plain",
                            charset="utf-8", headers={"X-Prometheus-Format": "0.0.4"})

    async def status(self, request: web.Request) -> web.Response:
        try:
            view = await self.bus.request(self.subjects.cluster_status(), ClusterStatusRequest(),
                                          timeout_s=self.settings.status_timeout_s)
            body = {"source": "autoscaler", **view.model_dump(mode="json")}
        except ServiceError as exc:  # autoscaler down: the registry alone, without load
            body = {"source": f"registry ({exc.message})", "timestamp": time.time(),
                    "workers": [{"info": w.model_dump(mode="json"), "load": None, "load_age_s": None}
                                for w in self.workers]}
        body["services"] = await self._service_processes()
        body["gateway"] = {"in_flight": self.metrics.in_flight.value(), "models": self.served_models(),
                           "num_restarts": self.settings.num_restarts,
                           "urls": self.settings.gateway_urls.split(",") if self.settings.gateway_urls else []}
        return web.json_response(body)


    async def _service_processes(self) -> list[dict]:
        """The announced service processes (shared.runtime.announce); empty if NATS cannot say."""
        try:
            if self._services is None:
                self._services = await open_services(self.bus, self.settings.namespace, self.settings.registry_ttl_s)
            return [s.model_dump(mode="json") for s in await list_services(self._services)]
        except Exception as exc:  # noqa: BLE001 — the status page shows the rest all the same
            log.warning("listing service processes failed: %r", exc)
            return []


def build_app(gateway: Gateway) -> web.Application:
    app = web.Application(middlewares=[errors_middleware(gateway.metrics.requests)],
                          client_max_size=gateway.settings.max_request_bytes)
    app.router.add_post("/v1/chat/completions", gateway.chat_completions)
    app.router.add_post("/v1/completions", gateway.completions)
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_get("/health", gateway.health)
    app.router.add_get("/ready", gateway.ready)
    app.router.add_get("/metrics", gateway.metrics_text)
    app.router.add_get("/status", gateway.status)
    return app


async def run(settings: GatewaySettings, stop: asyncio.Event) -> None:
    tokenizer = await asyncio.to_thread(load_tokenizer, settings.model)
    async with bus_connection("gateway", settings) as (bus, registry):
        gateway = Gateway(settings, bus, registry, tokenizer)
        async with http_site(build_app(gateway), settings.host, settings.port) as port:
            log.info("gateway listening on http://%s:%d (model %s)", settings.host, port, settings.model)
            await serve_until_stopped("gateway", gateway, stop, settings.namespace)
