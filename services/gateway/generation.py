"""One request's life in the gateway: admission, the worker's token stream, incremental
detokenization, reasoning apart from the content (``shared.openai_api.reasoning``) and stop strings
on the content. Errors come out as ``ApiError`` with the HTTP status to send.

If the worker is lost mid-stream (it leaves the registry, stops answering, or refuses), the
request is admitted again with the tokens generated so far appended to the prompt and the
remaining ``max_tokens``: the client sees one uninterrupted stream. When no worker can take it
(the only one died and its supervisor is restarting it), the request waits for a ready worker,
for at most ``request_timeout_s``, rather than failing. A NATS restart is handled the same way: the
stream cut by the disconnect may have lost tokens, so the request continues from the tokens
received, admitted again once admission answers.

A worker that breaks the protocol on a request (a chunk that does not parse, e.g. an unknown
``finish_reason``; the end marker before the last chunk; silence past the token deadline) is told
so in the cancel's reason, counted by worker and reason, and not chosen again for this request
(``GenerateRequest.exclude_workers``, until it restarts): the request goes to another worker, or
ends in a 502 with an OpenAI error body (an error event, then ``[DONE]``, mid-stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Protocol

from shared.bus import Bus, BusTimeout, Disconnected, MalformedReply, NoResponders, RemoteError, ServiceError
from shared.openai_api.adapters import Delta
from shared.openai_api.errors import ApiError
from shared.openai_api.reasoning import ReasoningSplitter, Start
from shared.openai_api.stop import StopStringMatcher
from shared.policy.attempts import MAX_ADMISSIONS, Attempts, Failure, Next, next_attempt
from shared.protocol import (AdmissionDecision, CancelRequest, ControlRequest, GenerateRequest, Subjects,
                             TokenChunk)
from shared.tokenizer import IncrementalDetokenizer, Tokenizer
from services.gateway.config import GatewaySettings
from services.gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

_WATCH_INTERVAL_S = 0.5
_NO_WORKER = ("unavailable", "worker_unavailable")  # ApiError codes worth waiting out after a loss


class WorkerLost(Exception):
    pass


class WorkerMisbehaved(WorkerLost):
    """The worker broke the protocol: ``reason`` is the metric's label, the message the detail."""

    def __init__(self, worker_id: str, reason: str, detail: str) -> None:
        super().__init__(f"worker {worker_id} {detail}")
        self.worker_id, self.reason, self.detail = worker_id, reason, detail


class WorkerDirectory(Protocol):
    """What a generation asks about the decode workers (the gateway's view of the registry)."""

    def started_at(self, worker_id: str) -> float | None:
        """The registered worker's start time; None: not registered. It tells a worker that died
        and came back under the same id from the one a stream was opened with."""

    def has_ready_worker(self, model: str) -> bool:
        """Whether a decode worker of ``model`` is ready to take a request."""

    def block_hashes(self, prompt_token_ids: list[int], model: str) -> list[int]:
        """The prompt's prefix-block hashes as the ready workers of ``model`` hash them."""


class Generation:
    def __init__(self, bus: Bus, subjects: Subjects, settings: GatewaySettings, tokenizer: Tokenizer,
                 metrics: GatewayMetrics, request: GenerateRequest, stops: list[str], *,
                 workers: WorkerDirectory, arrived_at: float | None = None,
                 reasoning: Start | None = None, kept_special_ids: frozenset[int] = frozenset()) -> None:
        """``kept_special_ids``: special tokens the output's text keeps (``ApiAdapter.kept_token_ids``:
        the tool-call markers its parser reads); the others are skipped."""
        self._bus, self._subjects, self._settings = bus, subjects, settings
        self._metrics = metrics
        self._workers = workers
        self._worker_started_at: float | None = None
        self.request = request          # what the client asked for
        self._current = request         # what the current worker runs (differs after a migration)
        self._detok = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, kept_special_ids=kept_special_ids)
        self._reasoning = ReasoningSplitter(reasoning)  # None: all of the output is content
        self._stop = StopStringMatcher(stops)  # on the content only
        self._stream: AsyncIterator[TokenChunk] | None = None
        self._first: TokenChunk | None = None
        self._generated: list[int] = []
        self._decode_path: str | None = None  # the current worker's path for its decode rows
        self._num_text_chunks = 0  # a text worker's chunks without token ids (one token each in usage)
        self._num_migrations = 0
        self._has_lost_worker = False  # a worker was lost before the first token: wait for another
        # workers that broke the protocol on this request → their start time then (a restart under
        # the same id is a new process, chosen again); the last such failure, for the 502
        self._excluded: dict[str, float | None] = {}
        self._misbehaviour: WorkerMisbehaved | None = None
        self.worker_id: str | None = None
        self._awaiting: tuple[str, str] | None = None  # (worker, request id) sent, its first chunk not in yet
        self.predicted_ttft_s: float | None = None  # admission's prediction for the current worker
        self.is_finished = False
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_cached_tokens = 0
        # the time to first token and its phases (shared.telemetry.phases), from the first worker
        # that answered; ``arrived_at``: when the HTTP request came in (time.monotonic())
        self._arrived_at = time.monotonic() if arrived_at is None else arrived_at
        self._admission_s = 0.0
        self._first_admission_at: float | None = None
        self._admitted_at = self._arrived_at
        self.ttft_s: float | None = None
        self.phases: dict[str, float] = {}

    @property
    def num_completion_tokens(self) -> int:
        return len(self._generated) + self._num_text_chunks

    async def start(self) -> None:
        """Admit the request and wait for its first token (so errors can still be a plain 4xx/5xx)."""
        started = time.monotonic()
        try:
            await self._open(self.request)
        except ApiError as exc:  # no worker: waited out (by _reopen) if one was lost, else the answer
            waits = Attempts(wait_until=math.inf if self._has_lost_worker else None)
            if exc.code not in _NO_WORKER or next_attempt(time.monotonic(), Failure.NO_WORKER, waits) is Next.FAIL:
                raise
            await self._reopen(self.request, str(exc))
        self._metrics.observe_ttft(time.monotonic() - started, self.request.tier)

    async def _open(self, request: GenerateRequest) -> None:
        for attempt in range(1, MAX_ADMISSIONS + 1):  # every failure below ends the loop or asks again
            tries = Attempts(num_admissions=attempt)
            request = self._excluding(request)
            decision = await self._admit(request)
            worker_id = decision.worker_id
            if decision.kv_source != request.kv_source:  # the worker may fetch the prefix from it
                request = request.model_copy(update={"kv_source": decision.kv_source})
            started_at = self._workers.started_at(worker_id)
            self._stream = self._bus.stream(
                self._subjects.decode_generate(worker_id), request,
                first_timeout_s=self._settings.request_timeout_s,
                idle_timeout_s=self._settings.token_idle_timeout_s)
            opened_at = time.monotonic()
            try:
                self._first = await self._first_chunk(worker_id, started_at, request.request_id)
            except WorkerMisbehaved as exc:
                await self._misbehaved(exc, request.request_id)
                if next_attempt(time.monotonic(), Failure.MISBEHAVED, tries) is Next.FAIL:
                    raise self._bad_worker_error() from None
                continue
            except (WorkerLost, Disconnected) as exc:  # e.g. died during a long (remote) prefill: nothing sent yet
                self._has_lost_worker = True
                await self._cancel(worker_id, request.request_id)
                if next_attempt(time.monotonic(), Failure.LOST, tries) is Next.FAIL:
                    raise ApiError(503, str(exc), code="worker_unavailable", retry_after_s=1.0) from None
                log.info("%s: %s before the first token; admitting again", request.request_id, exc)
                continue
            except (NoResponders, RemoteError) as exc:
                if exc.code == "bad_request":  # Failure.BAD_REQUEST: the client's to fix
                    raise ApiError(400, exc.message, param=exc.field, code="invalid_value") from None
                self._has_lost_worker = True
                if next_attempt(time.monotonic(), Failure.REFUSED, tries) is Next.FAIL:
                    raise ApiError(503, f"decode worker {worker_id} failed: {exc.message}",
                                   code="worker_unavailable", retry_after_s=1.0) from None
                log.info("%s: worker %s: %s; admitting again", request.request_id, worker_id, exc.message)
                await asyncio.sleep(self._settings.refresh_interval_s)  # Next.WAIT: let views drop the worker
                continue
            except BusTimeout:  # Failure.TIMEOUT: the request fails
                await self._cancel(worker_id, request.request_id)
                raise ApiError(504, f"no token within {self._settings.request_timeout_s:g}s",
                               code="timeout") from None
            self.worker_id, self._current, self._worker_started_at = worker_id, request, started_at
            if self.ttft_s is None:
                self._note_first_token(opened_at)
            return

    async def _first_chunk(self, worker_id: str, started_at: float | None, request_id: str) -> TokenChunk:
        """The first chunk of the request just sent. Until it comes, or the wait fails (the caller
        then deals with the worker), the request is ``_awaiting``: a generation whose task is
        cancelled meanwhile (a cancelled background response or batch line) cancels it at the
        worker on ``close``, which would otherwise run it to max_tokens for nobody."""
        self._awaiting = (worker_id, request_id)
        cancelled = False
        try:
            return await self._watched(worker_id, started_at, awaiting_first=request_id)
        except StopAsyncIteration:
            raise WorkerMisbehaved(worker_id, "early_end", "ended the stream before its first chunk") from None
        except MalformedReply as exc:
            raise WorkerMisbehaved(worker_id, "malformed_chunk", f"sent a malformed chunk: {exc.detail}") from None
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            if not cancelled:
                self._awaiting = None

    def _excluding(self, request: GenerateRequest) -> GenerateRequest:
        """``request`` with the workers that misbehaved on it excluded (those since restarted not)."""
        excluded = [w for w, started_at in self._excluded.items() if self._workers.started_at(w) == started_at]
        if excluded == request.exclude_workers:
            return request
        return request.model_copy(update={"exclude_workers": excluded})

    async def _misbehaved(self, exc: WorkerMisbehaved, request_id: str) -> None:
        """Count it, log it, tell the worker (the cancel's reason) and choose it no more."""
        log.warning("%s: %s", request_id, exc)
        self._metrics.observe_worker_error(exc.worker_id, exc.reason)
        self._excluded[exc.worker_id] = self._workers.started_at(exc.worker_id)
        self._misbehaviour = exc
        await self._cancel(exc.worker_id, request_id, f"gateway: {exc.reason}: {exc.detail}")

    def _bad_worker_error(self) -> ApiError:
        return ApiError(502, f"decode {self._misbehaviour}", code="bad_worker_response")

    def _note_first_token(self, opened_at: float) -> None:
        """TTFT as the client sees it, less the network, and its phases: the gateway's own work
        (before admission, and between admission's answer and the request to the worker),
        admission's round trip, the worker's phases that came with the first chunk, and ``bus``:
        the rest of the wait for that chunk, i.e. the NATS hops to the worker and back and the
        scheduling of the processes in between."""
        now = time.monotonic()
        self.ttft_s = now - self._arrived_at
        first_admission_at = self._first_admission_at or self._arrived_at
        own = (first_admission_at - self._arrived_at) + (opened_at - self._admitted_at)
        worker = self._first.phases or {}
        bus = max(now - opened_at - sum(worker.values()), 0.0)
        self.phases = {"gateway": own, "admission": self._admission_s, **worker, "bus": bus}

    async def _ask_admission(self, request: GenerateRequest) -> AdmissionDecision:
        """Admission's decision. An unanswered ask (the instance that took it died, or none is
        subscribed while one restarts) is asked again on the queue group until
        ``admission_retry_s`` has passed: another instance, or the restarted one, answers it."""
        deadline = time.monotonic() + self._settings.admission_retry_s
        while True:
            try:
                return await self._bus.request(self._subjects.admission_submit(), request,
                                               timeout_s=self._settings.admission_timeout_s)
            except (BusTimeout, NoResponders) as exc:
                if time.monotonic() >= deadline:
                    raise ApiError(503, f"admission unavailable: {exc.message}", code="admission_unavailable",
                                   retry_after_s=1.0) from None
                log.info("%s: admission: %s; asking again", request.request_id, exc.message)
                if isinstance(exc, NoResponders):  # nobody subscribed: give a restart a moment
                    await asyncio.sleep(self._settings.refresh_interval_s)
            except ServiceError as exc:
                raise ApiError(503, f"admission unavailable: {exc.message}", code="admission_unavailable",
                               retry_after_s=1.0) from None

    async def _admit(self, request: GenerateRequest) -> AdmissionDecision:
        asked_at = time.monotonic()
        if self._first_admission_at is None:
            self._first_admission_at = asked_at
        try:
            decision = await self._ask_admission(request)
        finally:
            self._admitted_at = time.monotonic()
            self._admission_s += self._admitted_at - asked_at
        if not decision.is_admitted:
            if decision.reject_reason == "unavailable" and request.exclude_workers and self._misbehaviour:
                raise self._bad_worker_error()  # no other worker: the failure is the bad one's
            self._metrics.observe_rejected(request.tier, decision.reject_reason or "unknown")
            # no worker at all is the service being down (503); everything else is load (429)
            status = 503 if decision.reject_reason in ("unavailable", None) else 429
            raise ApiError(status, decision.message, code=decision.reject_reason,
                           retry_after_s=decision.retry_after_s)
        assert decision.worker_id is not None, "admitted without a worker"
        self._metrics.observe_admitted(request.tier)
        self.predicted_ttft_s = decision.predicted_ttft_s
        return decision

    async def deltas(self) -> AsyncIterator[Delta]:
        """Text as it completes; the last delta has ``finish_reason``. Call after ``start``."""
        assert self._stream is not None and self._first is not None, "call start() first"
        chunk, last = self._first, time.monotonic()
        while True:
            yield self._to_delta(chunk)
            if self.is_finished:
                if chunk.finish_reason is None:  # a stop string ended it: free the worker now
                    await self._cancel(self.worker_id, self._current.request_id)
                return
            chunk = await self._next()
            now = time.monotonic()
            self._metrics.observe_itl(now - last)
            last = now

    async def _next(self) -> TokenChunk:
        try:
            return await self._next_from_worker()
        except WorkerLost as exc:
            misbehaved = isinstance(exc, WorkerMisbehaved)
            if misbehaved:
                await self._misbehaved(exc, self._current.request_id)
            tries = Attempts(num_migrations=self._num_migrations, streaming=True, is_text=self.request.is_text)
            failure = Failure.MISBEHAVED if misbehaved else Failure.LOST
            if next_attempt(time.monotonic(), failure, tries) is Next.MIGRATE:
                return await self._migrate(str(exc), cancelled=misbehaved)
            if self.request.is_text:  # its text so far cannot become another worker's prompt
                if not misbehaved:
                    await self._cancel(self.worker_id, self._current.request_id, "lost mid-stream")
                raise ApiError(502, f"text worker {self.worker_id} lost mid-stream: {exc}",
                               code="worker_lost") from None
            if misbehaved:
                raise self._bad_worker_error() from None
            raise ApiError(502, f"lost {self._num_migrations + 1} workers: {exc}") from None

    async def _watched(self, worker_id: str, started_at: float | None,
                       awaiting_first: str | None = None) -> TokenChunk:
        """The stream's next chunk, raising WorkerLost if the worker leaves the registry meanwhile
        (or is replaced by a new one under its id: ``started_at`` differs). ``awaiting_first``: the
        id of the request whose first chunk this is; the worker is asked every
        ``lost_request_check_s`` whether it runs it, and two noes in a row raise WorkerLost: core
        NATS delivers at most once, so the request or its first replies can vanish (a NATS member
        lost with them on the way), and nothing else would end the wait before ``request_timeout_s``."""
        next_chunk = asyncio.ensure_future(anext(self._stream))
        check_s = self._settings.lost_request_check_s if awaiting_first is not None else 0.0
        next_check_at = time.monotonic() + check_s
        asking: asyncio.Future[bool | None] | None = None
        noes = 0
        try:
            while True:
                done, _ = await asyncio.wait({next_chunk}, timeout=min(_WATCH_INTERVAL_S, check_s or math.inf))
                if done:
                    return next_chunk.result()
                now_started_at = self._workers.started_at(worker_id)
                if now_started_at is None:
                    raise WorkerLost(f"worker {worker_id} left the registry")
                if started_at is not None and now_started_at != started_at:
                    raise WorkerLost(f"worker {worker_id} was restarted")
                if asking is not None and asking.done():
                    noes = noes + 1 if asking.result() is False else 0
                    asking = None
                    if noes >= 2:
                        raise WorkerLost(f"worker {worker_id} does not have request {awaiting_first}: it or "
                                         f"its first replies were lost on the way")
                if check_s and asking is None and time.monotonic() >= next_check_at:
                    asking = asyncio.ensure_future(self._runs_there(worker_id, awaiting_first))
                    next_check_at = time.monotonic() + check_s
        finally:
            for pending in (next_chunk, asking):
                if pending is not None and not pending.done():  # let the stream unsubscribe before anyone closes it
                    pending.cancel()
                    await asyncio.wait({pending})

    async def _runs_there(self, worker_id: str, request_id: str) -> bool | None:
        """Whether the worker says it runs the request; None: no answer, or it does not say."""
        try:
            result = await self._bus.request(self._subjects.control(worker_id),
                                             ControlRequest(action="status", request_id=request_id),
                                             timeout_s=min(self._settings.lost_request_check_s, 2.0))
        except Exception as exc:  # noqa: BLE001 — a timeout, no responders, an error or malformed reply,
            # NATS reconnecting: it does not say
            log.debug("%s: asking worker %s about it: %s", request_id, worker_id, exc)
            return None
        return result.holds_request

    async def _next_from_worker(self) -> TokenChunk:
        """The next chunk, watching that the worker is still registered while waiting."""
        try:
            return await self._watched(self.worker_id, self._worker_started_at)
        except StopAsyncIteration:
            raise WorkerMisbehaved(self.worker_id, "early_end",
                                   "ended the stream before a chunk with a finish_reason") from None
        except MalformedReply as exc:
            raise WorkerMisbehaved(self.worker_id, "malformed_chunk", f"sent a malformed chunk: {exc.detail}") from None
        except BusTimeout as exc:
            raise WorkerMisbehaved(self.worker_id, "timeout", f"sent nothing for "
                                   f"{self._settings.token_idle_timeout_s:g}s ({exc.message})") from None
        except (NoResponders, Disconnected) as exc:
            raise WorkerLost(f"worker {self.worker_id}: {exc.message}") from None
        except RemoteError as exc:
            if exc.code == "rejected":
                raise WorkerLost(f"worker {self.worker_id}: {exc.message}") from None
            raise ApiError(502, f"worker failed mid-stream: {exc.message}") from None  # Failure.FAILED

    async def _migrate(self, why: str, *, cancelled: bool = False) -> TokenChunk:
        self._num_migrations += 1
        self._metrics.observe_migration()
        if not cancelled:
            await self._cancel(self.worker_id, self._current.request_id, "continued on another worker")
        prompt = self.request.prompt_token_ids + self._generated
        remaining = self.request.sampling.max_tokens - len(self._generated)
        request = self.request.model_copy(update={
            "request_id": f"{self.request.request_id}-m{self._num_migrations}",
            "prompt_token_ids": prompt, "block_hashes": self._workers.block_hashes(prompt, self.request.model),
            "sampling": self.request.sampling.model_copy(update={
                "max_tokens": remaining, "num_output_in_prompt": len(self._generated),
                "decode_path": self._decode_path})})
        log.warning("%s: %s; continuing elsewhere after %d tokens", self.request.request_id, why,
                    len(self._generated))
        await self._reopen(request, why)
        return self._first

    async def _reopen(self, request: GenerateRequest, why: str) -> None:
        """After losing the worker: open ``request`` on a ready one, waiting for one (the only
        worker may be restarting) until ``request_timeout_s``."""
        log.info("%s: %s; admitting again", request.request_id, why)
        deadline = time.monotonic() + self._settings.request_timeout_s
        while True:
            await self._wait_for_ready_worker(deadline)
            try:
                await self._open(request)
                return
            except ApiError as exc:  # admission's view may lag ours, NATS may be reconnecting: ask
                # again until the deadline
                waits = Attempts(wait_until=deadline)
                if exc.code not in _NO_WORKER + ("admission_unavailable",) or \
                        next_attempt(time.monotonic(), Failure.NO_WORKER, waits) is Next.FAIL:
                    raise
                await asyncio.sleep(self._settings.refresh_interval_s)

    async def _wait_for_ready_worker(self, deadline: float) -> None:
        """Until the registry view (refreshed every ``refresh_interval_s``) lists a ready decode
        worker: the only one may have died and be on its way back."""
        if self._workers.has_ready_worker(self.request.model):
            return
        log.info("%s: no ready decode worker; waiting up to %.0fs for one", self.request.request_id,
                 deadline - time.monotonic())
        while not self._workers.has_ready_worker(self.request.model):
            if time.monotonic() >= deadline:
                raise ApiError(503, f"no decode worker ready within {self._settings.request_timeout_s:g}s "
                               f"to continue the request", code="unavailable", retry_after_s=1.0)
            await asyncio.sleep(self._settings.refresh_interval_s)

    def _to_delta(self, chunk: TokenChunk) -> Delta:
        if self._num_migrations == 0:
            self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)
        self._generated.extend(chunk.token_ids)
        self._decode_path = chunk.decode_path or self._decode_path
        if chunk.text is not None and self.request.is_text:  # a text worker: its own tokenizer's text
            self._num_text_chunks += 0 if chunk.token_ids else 1
            self.num_prompt_tokens = max(self.num_prompt_tokens, chunk.num_prompt_tokens)
            piece = chunk.text
        else:
            piece = self._detok.push(chunk.token_ids)
        reasoning, content = self._reasoning.push(piece)
        text = self._stop.push(content)
        finish = chunk.finish_reason
        if finish is not None and not self._stop.is_stopped:
            last_reasoning, last_content = self._reasoning.push(self._detok.flush())
            held_reasoning, held_content = self._reasoning.flush()
            reasoning += last_reasoning + held_reasoning
            text += self._stop.push(last_content + held_content)
            text += self._stop.flush()
        if self._stop.is_stopped:
            finish = "stop"
        self.is_finished = finish is not None
        return Delta(text, list(chunk.logprobs or []), finish, reasoning)

    async def close(self) -> None:
        """End the request: if it is still running (client gone, error, its task cancelled), cancel it
        at the worker, and so a request sent and not answered yet (``_first_chunk``)."""
        running = []
        if self.worker_id is not None and not self.is_finished:
            running.append((self.worker_id, self._current.request_id))
        if self._awaiting is not None and self._awaiting not in running:
            running.append(self._awaiting)
        for worker_id, request_id in running:
            await self._cancel(worker_id, request_id)
        if self._stream is not None:
            with contextlib.suppress(RuntimeError):  # already closed by a cancelled read
                await self._stream.aclose()

    async def _cancel(self, worker_id: str | None, request_id: str, reason: str | None = None) -> None:
        if worker_id is None:
            return
        cancel = CancelRequest(request_id=request_id) if reason is None else \
            CancelRequest(request_id=request_id, reason=reason)
        try:
            await self._bus.publish(self._subjects.decode_cancel(worker_id), cancel)
        except Exception as exc:  # noqa: BLE001 — the worker finishes on its own at max_tokens
            log.warning("cancel of %s at %s failed: %s", request_id, worker_id, exc)
