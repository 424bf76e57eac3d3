"""gateway: the OpenAI-compatible HTTP API in front of admission and the decode workers.

Here happen validation, API-key tiers, the chat template, tokenization, the prompt's block hashes,
SSE streaming, incremental detokenization and stop strings. A client that disconnects cancels its
request at the worker (aiohttp cancels the handler; ``Generation.close`` publishes the cancel).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from aiohttp import web
from pydantic import ValidationError

from shared.bus import Bus, ServiceError, WorkerRegistry
from shared.kvcache.hashing import hash_blocks
from shared.openai_api import responses
from shared.openai_api.errors import ApiError, from_validation_error
from shared.openai_api.models import ChatCompletionRequest, CompletionRequest
from shared.protocol import ClusterStatusRequest, GenerateRequest, SamplingParams, Subjects, WorkerInfo
from shared.telemetry.metrics import LATENCY_BUCKETS_S, Counter, Gauge, Histogram, Registry
from shared.tokenizer import Tokenizer
from services.gateway.config import GatewaySettings
from services.gateway.generation import Delta, GatewayMetrics, Generation

log = logging.getLogger(__name__)


def load_tokenizer(model: str) -> Tokenizer:
    from shared.model.registry import resolve_model  # noqa: PLC0415 — may fetch the model once

    source = resolve_model(model)
    return Tokenizer.from_gguf(source.path) if source.format == "gguf" else Tokenizer.from_hf_dir(source.path)


class Gateway:
    def __init__(self, settings: GatewaySettings, bus: Bus, registry: WorkerRegistry,
                 tokenizer: Tokenizer) -> None:
        self.settings = settings
        self.subjects = Subjects(settings.namespace)
        self.bus = bus
        self.registry = registry
        self.tokenizer = tokenizer
        self.workers: list[WorkerInfo] = []
        self._key_tiers = settings.api_key_tiers()
        self.metrics_registry = Registry()
        m = self.metrics_registry
        self.requests = m.add(Counter("tandem_gateway_requests_total", "HTTP requests by status"))
        self.in_flight = m.add(Gauge("tandem_gateway_in_flight", "generation requests in flight"))
        self.metrics = GatewayMetrics(
            requests=self.requests,
            rejected=m.add(Counter("tandem_gateway_rejected_total", "requests rejected by admission")),
            ttft=m.add(Histogram("tandem_gateway_ttft_seconds", "time to first token", LATENCY_BUCKETS_S)),
            itl=m.add(Histogram("tandem_gateway_itl_seconds", "inter-token latency", LATENCY_BUCKETS_S)),
            migrations=m.add(Counter("tandem_gateway_migrations_total",
                                     "requests continued on another worker after losing theirs")))
        self.generated = m.add(Counter("tandem_gateway_generated_tokens_total", "completion tokens"))

    # --- cluster view ----------------------------------------------------------------------------
    async def refresh_forever(self) -> None:
        while True:
            try:
                self.workers = await self.registry.list()
            except Exception as exc:  # noqa: BLE001 — keep the last view while NATS reconnects
                log.warning("registry refresh failed: %s", exc)
            await asyncio.sleep(self.settings.refresh_interval_s)

    def ready_workers(self, model: str | None = None) -> list[WorkerInfo]:
        return [w for w in self.workers if w.role == "decode" and w.state == "ready"
                and (model is None or w.model == model)]

    def served_models(self) -> list[str]:
        return sorted({self.settings.model} | {w.model for w in self.ready_workers()})

    # --- request building ------------------------------------------------------------------------
    def _tier(self, request: web.Request) -> str:
        if not self._key_tiers:
            return "default"
        auth = request.headers.get("Authorization", "")
        key = auth.removeprefix("Bearer ").strip()
        if key not in self._key_tiers:
            raise ApiError(401, "missing or invalid API key", code="invalid_api_key")
        return self._key_tiers[key]

    def _generate_request(self, body, prompt_ids: list[int], tier: str) -> GenerateRequest:
        if body.model not in self.served_models():
            raise ApiError(404, f"model {body.model!r} does not exist; served: {self.served_models()}",
                           param="model", code="model_not_found")
        workers = self.ready_workers(body.model)
        max_len = min((w.max_model_len for w in workers), default=None)
        max_tokens = body.requested_max_tokens()
        if max_len is not None:
            if len(prompt_ids) >= max_len:
                raise ApiError(400, f"prompt has {len(prompt_ids)} tokens; this model's maximum "
                               f"context length is {max_len}", code="context_length_exceeded",
                               param="messages" if isinstance(body, ChatCompletionRequest) else "prompt")
            if max_tokens is not None and len(prompt_ids) + max_tokens > max_len:
                raise ApiError(400, f"max_tokens {max_tokens} + prompt {len(prompt_ids)} tokens exceeds "
                               f"the maximum context length {max_len}", param="max_tokens",
                               code="context_length_exceeded")
            if max_tokens is None:
                max_tokens = min(self.settings.default_max_tokens, max_len - len(prompt_ids))
        hashes = self._block_hashes(body.model, prompt_ids)
        sampling = SamplingParams(
            max_tokens=max_tokens or self.settings.default_max_tokens, temperature=body.temperature,
            top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, ignore_eos=body.ignore_eos,
            logprobs=body.num_logprobs())
        return GenerateRequest(request_id=f"{'chatcmpl' if isinstance(body, ChatCompletionRequest) else 'cmpl'}-"
                               f"{uuid.uuid4().hex}", model=body.model, prompt_token_ids=prompt_ids,
                               sampling=sampling, block_hashes=hashes, tier=tier, created_at=time.time())

    def _block_hashes(self, model: str, prompt_ids: list[int]) -> list[int]:
        """The prompt's chained block hashes as the model's workers compute them (admission
        looks them up in kv-index)."""
        workers = self.ready_workers(model)
        if not workers:
            return []
        return hash_blocks(prompt_ids, workers[0].block_size, bytes.fromhex(workers[0].kv_namespace_hex))

    def _is_registered(self, worker_id: str) -> bool:
        return any(w.worker_id == worker_id for w in self.workers)

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        return self.tokenizer.encode(text)

    def _completion_prompt(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            vocab = self.tokenizer.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            return list(prompt)
        text = prompt[0] if isinstance(prompt, list) else prompt
        ids = self.tokenizer.encode(text)
        if not ids:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        return ids

    # --- handlers --------------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        tier = self._tier(request)
        body = await _parse(request, ChatCompletionRequest)
        gen_request = self._generate_request(body, self._chat_prompt(body), tier)
        return await self._run(request, body, gen_request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        tier = self._tier(request)
        body = await _parse(request, CompletionRequest)
        gen_request = self._generate_request(body, self._completion_prompt(body), tier)
        return await self._run(request, body, gen_request, chat=False)

    async def _run(self, request: web.Request, body, gen_request: GenerateRequest, *,
                   chat: bool) -> web.StreamResponse:
        gen = Generation(self.bus, self.subjects, self.settings, self.tokenizer, self.metrics,
                         gen_request, body.stop_strings(), is_worker_alive=self._is_registered,
                         rehash=lambda ids: self._block_hashes(gen_request.model, ids))
        self.in_flight.inc()
        try:
            await gen.start()
            if body.stream:
                return await self._stream(request, body, gen, chat)
            return await self._collect(body, gen, chat)
        finally:
            self.in_flight.dec()
            self.generated.inc(gen.num_completion_tokens)
            await gen.close()

    async def _collect(self, body, gen: Generation, chat: bool) -> web.Response:
        texts, entries, finish = [], [], "length"
        async for delta in gen.deltas():
            texts.append(delta.text)
            entries.extend(delta.logprobs)
            finish = delta.finish_reason or finish
        text, rid, created = "".join(texts), gen.request.request_id, int(gen.request.created_at)
        usage = responses.usage(gen.num_prompt_tokens, gen.num_completion_tokens, gen.num_cached_tokens)
        token_text = self._token_text
        if chat:
            logprobs = responses.chat_logprobs(entries, token_text) if body.logprobs else None
            out = responses.chat_completion(rid, created, body.model, text, finish, logprobs, usage)
        else:
            logprobs = (responses.completion_logprobs(entries, token_text, 0)
                        if body.logprobs is not None else None)
            out = responses.completion(rid, created, body.model, text, finish, logprobs, usage)
        return web.json_response(out, headers=_ids(gen))

    async def _stream(self, request: web.Request, body, gen: Generation, chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache", **_ids(gen)})
        try:
            await resp.prepare(request)
            await self._write_events(resp, body, gen, chat)
        except ConnectionResetError:  # the client went away; _run's close() cancels at the worker
            log.info("%s: client disconnected", gen.request.request_id)
        return resp

    async def _write_events(self, resp: web.StreamResponse, body, gen: Generation, chat: bool) -> None:
        rid, created, model = gen.request.request_id, int(gen.request.created_at), body.model
        if chat:
            await _sse(resp, responses.chat_chunk(rid, created, model, {"role": "assistant", "content": ""}))
        offset = 0
        try:
            async for delta in gen.deltas():
                if not delta.text and not delta.finish_reason and not delta.logprobs:
                    continue
                await _sse(resp, self._chunk(body, delta, rid, created, chat, offset))
                offset += len(delta.text)
        except ApiError as exc:  # mid-stream: the status line is gone, report in the stream
            await _sse(resp, exc.body())
        if body.include_usage():
            usage = responses.usage(gen.num_prompt_tokens, gen.num_completion_tokens, gen.num_cached_tokens)
            name = "chat.completion.chunk" if chat else "text_completion"
            await _sse(resp, responses.usage_chunk(rid, created, model, name, usage))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()

    def _chunk(self, body, delta: Delta, rid: str, created: int, chat: bool, offset: int) -> dict:
        if chat:
            logprobs = (responses.chat_logprobs(delta.logprobs, self._token_text)
                        if body.logprobs and delta.logprobs else None)
            content = {"content": delta.text} if delta.text else {}
            return responses.chat_chunk(rid, created, body.model, content,
                                        finish_reason=delta.finish_reason, logprobs=logprobs)
        logprobs = (responses.completion_logprobs(delta.logprobs, self._token_text, offset)
                    if body.logprobs is not None and delta.logprobs else None)
        return responses.completion_chunk(rid, created, body.model, delta.text,
                                          finish_reason=delta.finish_reason, logprobs=logprobs)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "tandem"} for m in self.served_models()]})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        workers = self.ready_workers()
        status = 200 if workers else 503
        num_prefill = sum(1 for w in self.workers if w.role == "prefill" and w.state == "ready")
        return web.json_response({"ready": bool(workers), "num_ready_decode_workers": len(workers),
                                  "num_ready_prefill_workers": num_prefill}, status=status)

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics_registry.render(), content_type="text/plain",
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
        body["gateway"] = {"in_flight": self.in_flight.value(), "models": self.served_models()}
        return web.json_response(body)


def _ids(gen: Generation) -> dict[str, str]:
    """Which request and which worker: for logs, debugging and the routing tests."""
    return {"X-Request-Id": gen.request.request_id, "X-Tandem-Worker": gen.worker_id or ""}


async def _parse(request: web.Request, model):
    raw = await request.read()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def _sse(resp: web.StreamResponse, payload: dict) -> None:
    await resp.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """Every error as an OpenAI error body; count every response by status."""
    gateway = request.app[GATEWAY_KEY]
    try:
        resp = await handler(request)
    except ApiError as exc:
        headers = {}
        if exc.retry_after_s is not None and exc.status in (429, 503):
            headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
        resp = web.json_response(exc.body(), status=exc.status, headers=headers)
    except web.HTTPException as exc:  # 404 route, 405 method, 413 body too large
        resp = web.json_response(ApiError(exc.status, exc.reason).body(), status=exc.status)
    except asyncio.CancelledError:
        gateway.requests.inc(status="499")  # client closed the connection (nginx's code)
        raise
    except Exception as exc:  # noqa: BLE001 — a bug: log it, answer 500, keep serving
        log.exception("unhandled error on %s", request.path)
        resp = web.json_response(ApiError(500, f"internal error: {type(exc).__name__}").body(), status=500)
    if request.path.startswith("/v1/"):  # probes and scrapes are not requests
        gateway.requests.inc(status=str(resp.status))
    return resp


GATEWAY_KEY = web.AppKey("gateway", Gateway)


def build_app(gateway: Gateway) -> web.Application:
    app = web.Application(middlewares=[errors_middleware], client_max_size=gateway.settings.max_request_bytes)
    app[GATEWAY_KEY] = gateway
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
    bus = await Bus.connect(settings.nats_url, "gateway")
    runner = None
    refresher = None
    try:
        registry = await WorkerRegistry.open(bus, Subjects(settings.namespace).workers_bucket,
                                             ttl_s=settings.registry_ttl_s, watch=True)
        gateway = Gateway(settings, bus, registry, tokenizer)
        refresher = asyncio.create_task(gateway.refresh_forever())
        runner = web.AppRunner(build_app(gateway), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        port = runner.addresses[0][1]
        log.info("gateway listening on http://%s:%d (model %s)", settings.host, port, settings.model)
        await stop.wait()
    finally:
        if refresher:
            refresher.cancel()
        if runner:
            await runner.cleanup()
        await bus.close()
