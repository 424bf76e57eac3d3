"""gateway: the OpenAI-compatible HTTP API in front of admission and the decode workers.

The handlers are written once for both endpoints against an ``ApiAdapter`` (shared/openai_api):
API key and ``service_tier`` → tier (``serve_tier``), body → prompt ids → ``GenerateRequest``
(with the context rules), then a ``Generation`` (admission, the worker's stream, detokenization,
stop strings) answered as JSON or SSE (``server.py``). A ``flex`` request waits out admission's
429s for load (``shared.openai_api.retry``) for up to ``flex_max_wait_s`` before its answer. A
client that disconnects cancels its request at the worker (aiohttp cancels the handler;
``Generation.close`` publishes the cancel).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web

from shared.bus import Bus, ServiceDirectory, ServiceError, WorkerRegistry
from shared.cluster.workers import ready_workers
from shared.openai_api.adapters import ApiAdapter, ChatAdapter, CompletionAdapter, parse_body
from shared.openai_api.auth import ApiKeys, OperatorKey
from shared.openai_api.errors import ApiError
from shared.openai_api.reasoning import Start
from shared.openai_api.retry import waiting_out_429s
from shared.policy.qos import ServedTier, load_qos, serve_tier
from shared.openai_api.generate_request import (DEADLINE_HEADER, build_generate_request, build_text_request,
                                                choice_requests, deadline_at, with_header_deadline,
                                                prompt_block_hashes, resolve_model)
from shared.openai_api.responses_api import ResponsesAdapter
from shared.openai_api.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from shared.openai_api.stored.conversation_store import ConversationStore
from shared.openai_api.stored.store import ResponseStore
from shared.protocol import (ClusterStatusRequest, ClusterStatusResult, GenerateRequest, OriginAlive, OriginPing,
                             ServiceInfo, Subjects, WorkerInfo, WorkerStatus)
from shared.protocol.status import GatewayState, StatusPage
from services.framework.lifecycle import (bus_connection, every, published_metrics, serve_until_stopped,
                                    service_instance_id)
from shared.store.rate_limit import open_rate_limiter
from shared.telemetry import tracing
from shared.telemetry.logs import bind_request_id
from shared.telemetry.metrics import exposition
from shared.telemetry.redact import redact_url
from shared.tokenizer import Tokenizer, load_tokenizer
from services.gateway.batch_api import Batches
from services.gateway.config import GatewaySettings
from services.gateway.conversations import Conversations
from services.gateway.dashboard import add_dashboard_routes
from services.gateway.unsupported import add_unsupported_routes
from services.gateway.generation import Generation
from services.gateway.server import (OnComplete, collect_body, errors_middleware, http_site, operator_middleware,
                                     respond)
from services.gateway.stored_responses import StoredResponses
from services.gateway.metrics import GatewayMetrics
from services.gateway.rate_limit import closing_limiter, rate_limit_middleware

__all__ = ["Gateway", "build_app", "load_tokenizer", "run"]  # load_tokenizer: tests import it here

log = logging.getLogger(__name__)

# takes a parsed request from the handler: (HTTP request, adapter, where it runs, arrived_at) → response
Answer = Callable[[web.Request, ApiAdapter, ServedTier, float], Awaitable[web.StreamResponse]]


class Gateway:
    def __init__(self, settings: GatewaySettings, bus: Bus, registry: WorkerRegistry,
                 tokenizer: Tokenizer, services: ServiceDirectory | None = None,
                 responses: ResponseStore | None = None,
                 conversations: ConversationStore | None = None) -> None:
        self.settings = settings
        self.subjects = Subjects(settings.namespace)
        self.bus = bus
        self.registry = registry
        self.tokenizer = tokenizer
        self.workers: list[WorkerInfo] = []
        self.qos = load_qos(settings.qos)
        self.api_keys = ApiKeys.load(settings.api_keys, settings.api_keys_file, self.qos)
        self.operator_key = OperatorKey.load(settings.operator_key_file)
        # every API call takes a token (build_app's middleware); in Redis, one bucket per key for
        # every gateway of the stack
        self.rate_limiter = (open_rate_limiter(settings.rate_limit_per_s, settings.rate_limit_burst,
                                               settings.redis_url, settings.namespace,
                                               timeout_s=settings.rate_limit_redis_timeout_s)
                             if settings.rate_limit_per_s else None)
        self.metrics = GatewayMetrics.create(settings.num_restarts, service_instance_id("gateway"))
        self.services = services  # None: no metrics addresses in /status
        # named in every request this gateway sends: workers abort its requests once nobody
        # answers here (services.worker.origins)
        self.origin = f"gw-{uuid.uuid4().hex[:16]}"
        # None: responses (conversations) are not stored (a gateway embedded without NATS KV, in tests)
        self.conversations = Conversations(self, conversations) if conversations is not None else None
        self.stored = StoredResponses(self, responses, self.conversations) if responses is not None else None

    # --- lifecycle and cluster view --------------------------------------------------------------
    async def start(self) -> None:
        """The HTTP site is the gateway's endpoint; on the bus it only answers "still here"."""
        await self.bus.serve(self.subjects.origin_alive(self.origin), self.alive)

    async def alive(self, ping: OriginPing) -> OriginAlive:
        return OriginAlive(origin=self.origin)

    async def run_forever(self) -> None:
        await every(self.settings.refresh_interval_s, self.refresh, "registry refresh")

    async def refresh(self) -> None:
        self.workers = await self.registry.list()

    def ready_workers(self, model: str | None = None) -> list[WorkerInfo]:
        return ready_workers(self.workers, "decode", model)

    def served_models(self) -> list[str]:
        return sorted({self.settings.model} | {w.model for w in self.ready_workers()})

    # --- the worker directory a Generation asks (services.gateway.generation.WorkerDirectory) ------
    def started_at(self, worker_id: str) -> float | None:
        return next((w.started_at for w in self.workers if w.worker_id == worker_id), None)

    def has_ready_worker(self, model: str) -> bool:
        return bool(self.ready_workers(model))

    def block_hashes(self, prompt_token_ids: list[int], model: str) -> list[int]:
        return prompt_block_hashes(prompt_token_ids, self.ready_workers(model))

    # --- generation ------------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, ChatAdapter)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, CompletionAdapter)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, ResponsesAdapter, self.stored.create if self.stored else None)

    async def _generate(self, request: web.Request, adapter: type[ApiAdapter],
                        answer: Answer | None = None) -> web.StreamResponse:
        """One trace per request: the client's ``traceparent`` is its parent when it sends one.
        ``answer`` takes the parsed request from there (default: ``self.answer``)."""
        arrived_at = time.monotonic()
        with tracing.edge_span(f"{request.method} {request.path}", request.headers,
                               **{"http.request.method": request.method, "url.path": request.path}) as span:
            resp = await self._generate_traced(request, adapter, arrived_at, answer or self.answer)
            if span is not None:
                span.set_attribute("http.response.status_code", resp.status)
            return resp

    async def _generate_traced(self, request: web.Request, adapter: type[ApiAdapter],
                               arrived_at: float, answer: Answer) -> web.StreamResponse:
        key_tier = self.api_keys.tier(request.headers.get("Authorization"))
        api = adapter.from_json(await request.read(), self.tokenizer)
        with_header_deadline(api, request.headers.get(DEADLINE_HEADER))
        return await answer(request, api, serve_tier(self.qos, api.body.service_tier, key_tier), arrived_at)

    async def answer(self, request: web.Request, api: ApiAdapter, served: ServedTier, arrived_at: float,
                     on_complete: OnComplete | None = None) -> web.StreamResponse:
        """Run the parsed request in ``served.tier`` and answer it over HTTP (``respond``: JSON or
        SSE), echoing ``served.service_tier``; a flex one (``served.waits``) waits out 429s first."""
        gen_request = await self.prepared_request(api, served.tier)
        bind_request_id(gen_request.request_id)
        self.metrics.observe_started()
        gens: list[Generation] = []
        try:
            max_wait_s = self.settings.flex_max_wait_s if served.waits else 0.0
            gens = await self._started(api, gen_request, arrived_at, max_wait_s)
            self.metrics.observe_phases(gens[0].phases)
            return await respond(request, api, gens, gen_request.request_id, on_complete, served.service_tier)
        finally:
            self.metrics.observe_ended()
            if any(g.worker_id is not None for g in gens):  # a first token: finished (or cut off)
                self.metrics.observe_finished(time.monotonic() - arrived_at, served.tier,
                                              sum(g.num_completion_tokens for g in gens))
            for gen in gens:  # before any await: a client that hung up cancels this task there
                _log_request(gen)
            await asyncio.gather(*(g.close() for g in gens))

    async def collect(self, api: ApiAdapter, gen_request: GenerateRequest, service_tier: str | None = None) -> dict:
        """The response body of ``gen_request`` (made by ``generate_request`` from ``api``), run to
        the end without HTTP: a batch line, a background response."""
        gens = await self._started(api, gen_request, time.monotonic(), 0.0)
        try:
            return await collect_body(api, gens, gen_request.request_id, service_tier)
        finally:
            await asyncio.gather(*(g.close() for g in gens))

    async def _started(self, api: ApiAdapter, gen_request: GenerateRequest, arrived_at: float,
                       max_wait_s: float) -> list[Generation]:
        """One generation per choice, each admitted and at its first token. A try that fails
        closes its generations (cancelling those started); 429s for load are tried again for up
        to ``max_wait_s`` (``waiting_out_429s``; 0: one try)."""
        reasoning = api.decide_reasoning(self.settings.reasoning_parser, gen_request)

        async def attempt() -> list[Generation]:
            gens = [self._generation(r, api.body.stop_strings(), arrived_at, reasoning, api.kept_token_ids())
                    for r in choice_requests(gen_request, api.body.num_choices())]
            try:
                # the first choice's prefill fills the prefix cache; the others then share its blocks
                await gens[0].start()
                await asyncio.gather(*(g.start() for g in gens[1:]))
            except BaseException:  # an error, or the client gone (cancelled): nothing is left running
                await asyncio.gather(*(g.close() for g in gens))
                raise
            return gens

        return await waiting_out_429s(attempt, max_wait_s, gen_request.request_id)

    async def prepared_request(self, api: ApiAdapter, tier: str) -> GenerateRequest:
        """``generate_request`` with the prompt's chat template and tokenization run in a thread
        (seconds for a long prompt, which every other request and /health would wait out on the
        event loop); the registry is read here, on the loop, where it changes."""
        prompt_ids = None
        api.decide_tool_format(self.settings.tool_call_parser)
        workers = self.ready_workers(resolve_model(api.body.model, self.served_models()))
        if not (workers and all(w.takes_text for w in workers)):
            prompt_ids = await asyncio.to_thread(api.prompt_ids)
        return self.generate_request(api, tier, time.time(), prompt_ids)

    def generate_request(self, api: ApiAdapter, tier: str, now: float,
                         prompt_ids: list[int] | None = None) -> GenerateRequest:
        """Tokenized and hashed here (``prompt_ids``: tokenized already), or, for a model that text
        workers serve, as text."""
        api.decide_tool_format(self.settings.tool_call_parser)  # again for a caller that skipped prepared_request
        priority = self.qos.tiers[tier].priority
        served = self.served_models()
        model = resolve_model(api.body.model, served)
        workers = self.ready_workers(model)
        if workers and all(w.takes_text for w in workers):
            request = build_text_request(api, model=model, tier=tier, priority=priority,
                                         default_max_tokens=self.settings.default_max_tokens, now=now)
        else:
            ids = prompt_ids if prompt_ids is not None else api.prompt_ids()
            request = build_generate_request(api, ids, tier=tier, priority=priority, workers=workers,
                                             served_models=served,
                                             default_max_tokens=self.settings.default_max_tokens, now=now)
        return request.model_copy(update={"origin": self.origin, "deadline_at": deadline_at(api, now)})

    def _generation(self, gen_request: GenerateRequest, stops: list[str], arrived_at: float,
                    reasoning: Start | None, kept_special_ids: frozenset[int]) -> Generation:
        return Generation(self.bus, self.subjects, self.settings, self.tokenizer, self.metrics,
                          gen_request, stops, workers=self, arrived_at=arrived_at, reasoning=reasoning,
                          kept_special_ids=kept_special_ids)

    # --- models, probes, metrics, status ---------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [_model_card(m) for m in self.served_models()]})

    async def model(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        if model_id not in self.served_models():
            raise ApiError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
        return web.json_response(_model_card(model_id))

    # /tokenize and /detokenize: behind the API key and the rate limit as /v1/* are (they spend the
    # gateway's CPU), and run in a thread: a large text would hold the event loop, /health included
    async def tokenize(self, request: web.Request) -> web.Response:
        self.api_keys.tier(request.headers.get("Authorization"))
        body = parse_body(await request.read(), TokenizeRequest)
        resolve_model(body.model, self.served_models())
        max_model_len = min((w.max_model_len for w in self.ready_workers(body.model)), default=None)
        return web.json_response(await asyncio.to_thread(tokenize, body, self.tokenizer, max_model_len,
                                                         max_chars=self.settings.max_tokenize_chars))

    async def detokenize(self, request: web.Request) -> web.Response:
        self.api_keys.tier(request.headers.get("Authorization"))
        body = parse_body(await request.read(), DetokenizeRequest)
        resolve_model(body.model, self.served_models())
        return web.json_response(await asyncio.to_thread(detokenize, body, self.tokenizer,
                                                         max_tokens=self.settings.max_detokenize_tokens))

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        workers = self.ready_workers()
        num_prefill = len(ready_workers(self.workers, "prefill"))
        return web.json_response({"ready": bool(workers), "num_ready_decode_workers": len(workers),
                                  "num_ready_prefill_workers": num_prefill}, status=200 if workers else 503)

    async def metrics_text(self, request: web.Request) -> web.Response:
        body, content_type = exposition(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response((await self.cluster_status()).model_dump(mode="json"))

    async def cluster_status(self) -> StatusPage:
        """The autoscaler's cluster view (the registry alone when it does not answer), every
        service's metrics address, and the gateway's own state: ``/status`` and the dashboard."""
        gateway = GatewayState(in_flight=self.metrics.num_in_flight, batch_lines_in_flight=self.metrics.num_batch_lines,
                               models=self.served_models(),
                               num_restarts=self.settings.num_restarts,
                               urls=self.settings.gateway_urls.split(",") if self.settings.gateway_urls else [],
                               nats_url=redact_url(self.settings.nats_url),
                               redis_url=redact_url(self.settings.redis_url or ""))
        try:
            view = await self.bus.request(self.subjects.cluster_status(), ClusterStatusRequest(),
                                          timeout_s=self.settings.status_timeout_s)
            source = "autoscaler"
        except ServiceError as exc:  # autoscaler down: the registry alone, without load
            source = f"registry ({exc.message})"
            view = ClusterStatusResult(timestamp=time.time(),
                                       workers=[WorkerStatus(info=w, load=None, load_age_s=None) for w in self.workers])
        return StatusPage(**dict(view), source=source, gateway=gateway, services=await self._services())

    async def _services(self) -> list[ServiceInfo]:
        """Every process in the service directory; empty if NATS cannot say (the status page
        shows the rest all the same)."""
        if self.services is None:
            return []
        try:
            return list(await self.services.list())
        except Exception as exc:  # noqa: BLE001 — NATS reconnecting: the status without them
            log.warning("service directory unavailable: %s", exc)
            return []



def _log_request(gen: Generation) -> None:
    """The request's one line: where it ran, its size, its TTFT and the phases of it."""
    if gen.ttft_s is None:
        return  # rejected or failed before its first token: the error path logged why
    phases = " ".join(f"{name}={seconds * 1000:.1f}" for name, seconds in gen.phases.items())
    log.info("%s: worker %s, %d+%d tokens (%d cached), TTFT %.1f ms [%s]", gen.request.request_id,
             gen.worker_id, gen.num_prompt_tokens, gen.num_completion_tokens, gen.num_cached_tokens,
             gen.ttft_s * 1000, phases)


def _log_access(gateway: Gateway, settings: GatewaySettings) -> None:
    """Who may use this gateway, said once at start: an open operator page or a key file others
    can read is a choice an operator should see."""
    keys = f"{len(gateway.api_keys.key_tiers)} API keys" if gateway.api_keys.key_tiers else "no API keys (no auth)"
    pages = ("need the operator key" if gateway.operator_key.is_configured
             else "open to anyone who reaches this port (no --operator-key-file)")
    log.info("%s; /status, /metrics and /dashboard %s", keys, pages)
    for path in (settings.api_keys_file, settings.operator_key_file):
        if path and os.stat(path).st_mode & 0o044:
            log.warning("%s is readable by other users than its owner (chmod 600 it)", path)


def _model_card(model_id: str) -> dict:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "tandem"}


def build_app(gateway: Gateway) -> web.Application:
    middlewares = [errors_middleware(gateway.metrics.observe_response), operator_middleware(gateway.operator_key)]
    if gateway.rate_limiter is not None:
        middlewares.append(rate_limit_middleware(gateway.rate_limiter, gateway.api_keys))
    app = web.Application(middlewares=middlewares, client_max_size=gateway.settings.max_request_bytes)
    app.router.add_post("/v1/chat/completions", gateway.chat_completions)
    app.router.add_post("/v1/completions", gateway.completions)
    app.router.add_post("/v1/responses", gateway.responses)
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_get("/v1/models/{model_id}", gateway.model)
    app.router.add_post("/tokenize", gateway.tokenize)
    app.router.add_post("/detokenize", gateway.detokenize)
    app.router.add_get("/health", gateway.health)
    app.router.add_get("/ready", gateway.ready)
    app.router.add_get("/metrics", gateway.metrics_text)
    app.router.add_get("/status", gateway.status)
    if gateway.stored is not None:
        gateway.stored.add_routes(app)
    if gateway.conversations is not None:
        gateway.conversations.add_routes(app)
    add_dashboard_routes(app, gateway)
    add_unsupported_routes(app)
    return app


async def run(settings: GatewaySettings, stop: asyncio.Event) -> None:
    tokenizer = await asyncio.to_thread(load_tokenizer, settings.model)
    async with bus_connection("gateway", settings) as (bus, registry):
        services = await ServiceDirectory.open(bus, Subjects(settings.namespace).services_bucket,
                                               ttl_s=settings.registry_ttl_s)
        responses = await ResponseStore.open(bus, Subjects(settings.namespace), ttl_s=settings.responses_ttl_s)
        conversations = await ConversationStore.open(bus, Subjects(settings.namespace))
        gateway = Gateway(settings, bus, registry, tokenizer, services, responses, conversations)
        app = build_app(gateway)
        batches = await Batches.open(gateway, gateway.stored.history)
        batches.add_routes(app)
        async with (closing_limiter(gateway.rate_limiter),  # exited last: after the site stopped serving
                    http_site(app, settings.host, settings.port) as port,
                    gateway.stored.running(),
                    published_metrics("gateway", service_instance_id("gateway"), settings, bus,
                                      gateway.metrics.registry),
                    batches.running()):
            log.info("gateway listening on http://%s:%d (model %s; dashboard /dashboard)", settings.host, port,
                     settings.model)
            _log_access(gateway, settings)
            await serve_until_stopped("gateway", gateway, stop, settings.namespace)
