"""One request's life in the gateway: admission, the worker's token stream, incremental
detokenization and stop strings. Errors come out as ``ApiError`` with the HTTP status to send."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from shared.bus import Bus, BusTimeout, NoResponders, RemoteError, ServiceError
from shared.openai_api.errors import ApiError
from shared.openai_api.stop import StopStringMatcher
from shared.protocol import CancelRequest, GenerateRequest, Subjects, TokenChunk, TokenLogprob
from shared.telemetry.metrics import Counter, Histogram
from shared.tokenizer import IncrementalDetokenizer, Tokenizer
from services.gateway.config import GatewaySettings

log = logging.getLogger(__name__)

_MAX_ATTEMPTS = 2  # a worker that drains or dies between admission and our request: admit again


@dataclass
class Delta:
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class GatewayMetrics:
    requests: Counter
    rejected: Counter
    ttft: Histogram
    itl: Histogram


class Generation:
    def __init__(self, bus: Bus, subjects: Subjects, settings: GatewaySettings, tokenizer: Tokenizer,
                 metrics: GatewayMetrics, request: GenerateRequest, stops: list[str]) -> None:
        self._bus, self._subjects, self._settings = bus, subjects, settings
        self._metrics = metrics
        self.request = request
        self._detok = IncrementalDetokenizer(tokenizer, request.prompt_token_ids)
        self._stop = StopStringMatcher(stops)
        self._stream: AsyncIterator[TokenChunk] | None = None
        self._first: TokenChunk | None = None
        self.worker_id: str | None = None
        self.is_finished = False
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_cached_tokens = 0
        self.num_completion_tokens = 0

    async def start(self) -> None:
        """Admit the request and wait for its first token (so errors can still be a plain 4xx/5xx)."""
        started = time.monotonic()
        for attempt in range(_MAX_ATTEMPTS):
            worker_id = await self._admit()
            self._stream = self._bus.stream(
                self._subjects.decode_generate(worker_id), self.request,
                first_timeout_s=self._settings.request_timeout_s,
                idle_timeout_s=self._settings.token_idle_timeout_s)
            try:
                self._first = await anext(self._stream)
            except (NoResponders, RemoteError) as exc:
                if exc.code == "bad_request":
                    raise ApiError(400, exc.message, param=exc.field, code="invalid_value") from None
                if attempt + 1 == _MAX_ATTEMPTS:
                    raise ApiError(503, f"decode worker {worker_id} failed: {exc.message}",
                                   code="worker_unavailable", retry_after_s=1.0) from None
                log.info("%s: worker %s: %s; admitting again", self.request.request_id, worker_id, exc.message)
                continue
            except BusTimeout:
                await self._cancel(worker_id)
                raise ApiError(504, f"no token within {self._settings.request_timeout_s:g}s",
                               code="timeout") from None
            self.worker_id = worker_id
            self._metrics.ttft.observe(time.monotonic() - started)
            return

    async def _admit(self) -> str:
        try:
            decision = await self._bus.request(self._subjects.admission_submit(), self.request,
                                               timeout_s=self._settings.admission_timeout_s)
        except ServiceError as exc:
            raise ApiError(503, f"admission unavailable: {exc.message}", code="admission_unavailable",
                           retry_after_s=1.0) from None
        if not decision.is_admitted:
            self._metrics.rejected.inc(reason=decision.reject_reason or "unknown")
            status = 429 if decision.reject_reason == "overloaded" else 503
            raise ApiError(status, decision.message, code=decision.reject_reason,
                           retry_after_s=decision.retry_after_s)
        assert decision.worker_id is not None, "admitted without a worker"
        return decision.worker_id

    async def deltas(self) -> AsyncIterator[Delta]:
        """Text as it completes; the last delta has ``finish_reason``. Call after ``start``."""
        assert self._stream is not None and self._first is not None, "call start() first"
        chunk, last = self._first, time.monotonic()
        while True:
            yield self._to_delta(chunk)
            if self.is_finished:
                if chunk.finish_reason is None:  # a stop string ended it: free the worker now
                    await self._cancel(self.worker_id)
                return
            try:
                chunk = await anext(self._stream)
            except StopAsyncIteration:
                raise ApiError(502, "worker ended the stream without a finish reason") from None
            except BusTimeout:
                raise ApiError(504, f"no token for {self._settings.token_idle_timeout_s:g}s",
                               code="timeout") from None
            except ServiceError as exc:
                raise ApiError(502, f"worker failed mid-stream: {exc.message}") from None
            now = time.monotonic()
            self._metrics.itl.observe(now - last)
            last = now

    def _to_delta(self, chunk: TokenChunk) -> Delta:
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)
        self.num_completion_tokens += len(chunk.token_ids)
        text = self._stop.push(self._detok.push(chunk.token_ids))
        finish = chunk.finish_reason
        if finish is not None and not self._stop.is_stopped:
            text += self._stop.push(self._detok.flush())
            text += self._stop.flush()
        if self._stop.is_stopped:
            finish = "stop"
        self.is_finished = finish is not None
        return Delta(text, list(chunk.logprobs or []), finish)

    async def close(self) -> None:
        """End the request: if it is still running (client gone, error), cancel it at the worker."""
        if self.worker_id is not None and not self.is_finished:
            await self._cancel(self.worker_id)
        if self._stream is not None:
            await self._stream.aclose()

    async def _cancel(self, worker_id: str | None) -> None:
        if worker_id is None:
            return
        try:
            await self._bus.publish(self._subjects.decode_cancel(worker_id),
                                    CancelRequest(request_id=self.request.request_id))
        except Exception as exc:  # noqa: BLE001 — the worker finishes on its own at max_tokens
            log.warning("cancel of %s at %s failed: %s", self.request.request_id, worker_id, exc)
